"""Countdown: the completion's equation (inside <answer>...</answer>, else its last line) must use each
of the given numbers exactly once with + - * / and brackets, and evaluate to the target. Evaluated on
the syntax tree, never with eval()."""
from __future__ import annotations

import ast
import re
from fractions import Fraction

from rlcu.rewards.base import Reward, checked_format_score, completion_text, require_column

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def evaluate(expr: str) -> tuple[Fraction, list[int]] | None:
    """(value, numbers used) of an arithmetic expression, or None if it is not one."""
    expr = expr.strip().split("=")[0].replace("×", "*").replace("÷", "/")
    if not expr or len(expr) > 200:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("not arithmetic")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError):
        return None


def equation_of(text: str) -> str:
    found = _ANSWER.findall(text)
    if found:
        return found[-1]
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class CountdownEquation(Reward):
    """1.0 for a correct equation; `format_score` for a wrong one given inside <answer> tags (TinyZero's
    partial credit, 0.1 there: a small model first learns to answer in the format, which gives GRPO
    something to compare before any answer is right); else 0.0. Columns: `nums` (list of ints) and
    `target` (int)."""
    name = "countdown"

    def __init__(self, nums_column: str = "nums", target_column: str = "target", weight: float = 1.0,
                 format_score: float = 0.0):
        self.nums_column, self.target_column, self.weight = nums_column, target_column, weight
        self.format_score = checked_format_score(format_score)

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        nums = require_column(self.name, self.nums_column, kwargs)
        targets = require_column(self.name, self.target_column, kwargs)
        out = []
        for c, ns, t in zip(completions, nums, targets):
            text = completion_text(c)
            result = evaluate(equation_of(text))
            ok = (result is not None and sorted(result[1]) == sorted(int(n) for n in ns)
                  and result[0] == Fraction(int(t)))
            out.append(1.0 if ok else self.format_score if _ANSWER.search(text) else 0.0)
        return out
