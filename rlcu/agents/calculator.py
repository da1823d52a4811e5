"""A calculator tool, written as TRL's docs write tools (a typed function with a Google-style docstring):
the calculator recipe gives it to a model that cannot multiply 3-digit numbers in its head. It evaluates
on the syntax tree (the countdown reward's evaluator), never with eval()."""
from __future__ import annotations

from rlcu.rewards.countdown import evaluate


def calculator(expression: str) -> str:
    """
    Evaluates an arithmetic expression with integers, + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "123 * 456".

    Returns:
        The value of the expression.
    """
    found = evaluate(str(expression))
    if found is None:
        raise ValueError(f"cannot evaluate {expression!r}: use integers, + - * / and parentheses")
    value = found[0]
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"
