"""The shape the house keeps: no function over 45 lines in the grpo, engine and models layers (constructors
included), and GRPOModule's constructor body (its docstring aside) within 40, its options defined once."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rlcu"
MAX_LINES = 45


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_longer_than_45_lines():
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for layer in ("grpo", "engine", "models") for p in sorted((ROOT / layer).rglob("*.py"))
            for f in functions(p) if f.end_lineno - f.lineno + 1 > MAX_LINES]
    assert long == []


def test_the_module_constructor_body_is_at_most_40_lines():
    init = next(f for f in functions(ROOT / "grpo" / "module.py") if f.name == "__init__")
    body = init.body[1:] if isinstance(init.body[0], ast.Expr) else init.body  # the docstring aside
    assert body[-1].end_lineno - body[0].lineno + 1 <= 40
