"""Embedded synthetic tasks, generated deterministically from a seed so no download is needed."""
from __future__ import annotations

import random

ARITHMETIC_QUESTION = "What is {a} {op} {b}? Give only the final number."
CALCULATOR_QUESTION = ("What is {a} * {b}? First call the calculator: <tool_call>\n{{\"name\": \"calculator\", "
                       "\"arguments\": {{\"expression\": \"{a} * {b}\"}}}}\n</tool_call>\n"
                       "Then give only the final number.")
COUNTDOWN_QUESTION = ("Using the numbers {nums}, create an equation that equals {target}. You can use + - * / and "
                      "brackets, and each number exactly once. Show your work in <think> </think> tags and give the "
                      "final equation in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>.")


def arithmetic(n: int = 1000, seed: int = 0, digits: int = 2, ops: str = "+", chat: bool = True) -> list[dict]:
    """'What is A + B? Give only the final number.' with the answer as a string: a chat prompt, or with
    `chat=False` the plain text 'Question: ...\nAnswer:' for a base model whose tokenizer has no chat template."""
    if n < 1 or digits < 1 or not ops or set(ops) - set("+-*") or not isinstance(chat, bool):
        raise ValueError(f"arithmetic needs n >= 1, digits >= 1, ops from '+-*' and chat true or false, "
                         f"got n={n}, digits={digits}, ops={ops!r}, chat={chat!r}")
    rng = random.Random(seed)
    lo, hi = (10 ** (digits - 1) if digits > 1 else 0), 10 ** digits - 1
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = ARITHMETIC_QUESTION.format(a=a, op=op, b=b)
        prompt = [{"role": "user", "content": question}] if chat else f"Question: {question}\nAnswer:"
        rows.append({"prompt": prompt, "answer": str(value)})
    return rows


def calculator(n: int = 1000, seed: int = 0, digits: int = 3) -> list[dict]:
    """'What is A * B?' for random `digits`-digit A and B, with the calculator tool's call shown in the prompt
    (a small model does not call a tool it has only seen described); the answer as a string."""
    if n < 1 or digits < 1:
        raise ValueError(f"calculator needs n >= 1 and digits >= 1, got n={n}, digits={digits}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"prompt": [{"role": "user", "content": CALCULATOR_QUESTION.format(a=a, b=b)}],
                     "answer": str(a * b)})
    return rows


def countdown(n: int = 1000, seed: int = 0, num_numbers: int = 3, max_number: int = 25) -> list[dict]:
    """Countdown puzzles that are solvable by construction: the target is computed from a random
    equation over the numbers, which are then shuffled."""
    if n < 1 or not 2 <= num_numbers <= 6:
        raise ValueError(f"countdown needs n >= 1 and 2 <= num_numbers <= 6, got n={n}, num_numbers={num_numbers}")
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        nums = [rng.randint(1, max_number) for _ in range(num_numbers)]
        value = nums[0]
        for x in nums[1:]:
            op = rng.choice("+-*")
            value = value + x if op == "+" else value - x if op == "-" else value * x
        if not 1 <= value <= 1000:
            continue
        shown = nums[:]
        rng.shuffle(shown)
        rows.append({"prompt": [{"role": "user", "content": COUNTDOWN_QUESTION.format(nums=shown, target=value)}],
                     "nums": shown, "target": value})
    return rows


TASKS = {"arithmetic": arithmetic, "calculator": calculator, "countdown": countdown}
