"""Math answer accuracy: extract the final answer (the last `\\boxed{...}`, else the last number) and
compare it with the reference numerically, then symbolically (sympy) for expressions.

Model output is untrusted: symbolic parsing only sees short strings made of digits, operators,
brackets and a few known names, with no attribute access, quotes or underscores, and exponents are
bounded, so nothing in a completion can run code or stall the run."""
from __future__ import annotations

import re
from fractions import Fraction

from rlcu.rewards.base import Reward, completion_text, require_column
from rlcu.text import last_boxed, last_number

_SAFE = re.compile(r"^[0-9a-z+\-*/^().,\s]*$")
_NAMES = {"sqrt", "pi", "e", "x", "y", "z", "n", "i", "log", "sin", "cos", "tan", "exp"}


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    return last_number(text)


def _latex_to_plain(s: str) -> str:
    s = s.strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("{", "(").replace("}", ")")
    s = re.sub(r"\\text\(([^()]*)\)", r"\1", s)
    s = s.replace("%", "").replace("^", "**")
    return s.lower()


def parse_number(s: str) -> Fraction | None:
    s = s.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".").rstrip("%")
    s = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", s)
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _parse_safely(s: str):
    """A sympy expression of a whitelisted string, unevaluated, or None if it is unsafe to simplify."""
    if len(s) > 120 or not _SAFE.match(s) or set(re.findall(r"[a-z]+", s)) - _NAMES:
        return None
    from sympy import Number, Pow
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    expr = parse_expr(s, transformations=standard_transformations + (implicit_multiplication_application,),
                      evaluate=False)
    for node in expr.atoms(Pow):
        exp = node.exp
        if not isinstance(exp, Number) or abs(exp) > 64 or node.base.find(Pow):
            return None  # 9**9**9 or x**(10**6) would stall simplify
    return expr


def symbolic_equal(a: str, b: str) -> bool:
    try:
        import sympy

        ea, eb = _parse_safely(_latex_to_plain(a)), _parse_safely(_latex_to_plain(b))
        if ea is None or eb is None:
            return False
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # unparsable model output is simply not equal
        return False


def answers_match(predicted: str | None, reference) -> bool:
    if predicted is None or reference is None:
        return False
    ref = str(reference)
    ref = extract_answer(ref) if "\\boxed" in ref or "####" in ref else ref
    p, r = parse_number(predicted), parse_number(ref)
    if p is not None and r is not None:
        return p == r
    if predicted.strip() == ref.strip():
        return True
    return symbolic_equal(predicted, ref)


class MathAnswer(Reward):
    """1.0 when the completion's final answer equals the dataset's `answer_column`, else 0.0;
    None for samples whose reference answer is missing."""
    name = "math_answer"

    def __init__(self, answer_column: str = "answer", weight: float = 1.0):
        self.answer_column, self.weight = answer_column, weight

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        answers = require_column(self.name, self.answer_column, kwargs)
        return [None if ref is None else float(answers_match(extract_answer(completion_text(c)), ref))
                for c, ref in zip(completions, answers)]
