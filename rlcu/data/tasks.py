"""Embedded synthetic tasks, generated deterministically from a seed so no download is needed."""
from __future__ import annotations

import random


def arithmetic(n: int, seed: int = 0, digits: int = 2, ops: str = "+") -> list[dict]:
    """'What is A + B? Give only the final number.' with the answer as a string (chat prompts)."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Give only the final number."}],
                     "answer": str(value)})
    return rows
