"""Dependencies point one way: kernels <- models <- engine <- rollout <- agents <- grpo <- (cli, callbacks, ...).
Leaf packages (rewards, data) and shared modules (contracts, plugins, ...) sit beside the layers: any
layer may import them, they import no layer and no other leaf package."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rlcu"
LAYERS = ["kernels", "models", "engine", "rollout", "agents", "grpo"]  # each may import those before it
TOP = {"cli", "callbacks", "bench", "generate", "export", "trl"}  # may import everything
LEAF_PACKAGES = {"rewards", "data"}  # may import themselves and the shared modules
SHARED = {"__init__", "calls", "contracts", "plugins", "hparams", "text", "paths", "pypi_files", "checkpoint", "quiet",
          "loggers", "profiling", "strategies", "devices"}


def part(module: str) -> str:
    """'rlcu.engine.scheduler' -> 'engine'; 'rlcu' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def allowed(src: str, dst: str) -> bool:
    """May a module of part `src` import one of part `dst`?"""
    if src == dst or dst in SHARED or src in TOP:
        return True
    if src in SHARED:
        return False
    if src in LEAF_PACKAGES:
        return False
    if dst in LEAF_PACKAGES:
        return True
    if src in LAYERS and dst in LAYERS:
        return LAYERS.index(dst) < LAYERS.index(src)
    return False


def imported_modules(module: str, source: str) -> set[str]:
    """The rlcu modules that `source` imports, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "rlcu"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlcu":
            # `from rlcu import plugins` imports rlcu.plugins; `from rlcu.grpo import loss` rlcu.grpo.loss
            subs = [f"{node.module}.{a.name}" for a in node.names] if node.module.count(".") <= 1 else []
            found |= set(subs) if subs and all(_is_module(s) for s in subs) else {node.module}
    return found


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_imports(module: str, source: str) -> list[str]:
    return [f"{module} imports {dst}" for dst in sorted(imported_modules(module, source))
            if not allowed(part(module), part(dst))]


def package_modules() -> dict[str, str]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p.read_text() for p in ROOT.rglob("*.py")}


def test_every_import_points_down_or_sideways_to_a_shared_module():
    modules = package_modules()
    unknown = sorted({part(m) for m in modules} - set(LAYERS) - TOP - LEAF_PACKAGES - SHARED)
    assert not unknown, f"place these in a layer of this test: {unknown}"
    bad = [edge for m, src in modules.items() for edge in upward_imports(m, src)]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


@pytest.mark.parametrize("module, source", [
    ("rlcu.kernels.rmsnorm", "from rlcu.models.decoder import CausalLM"),
    ("rlcu.engine.llm_engine", "from rlcu.rollout.base import RolloutBatch"),
    ("rlcu.engine.llm_engine", "def f():\n    import rlcu.grpo.module\n"),
    ("rlcu.rollout.native", "from rlcu.grpo import loss"),
    ("rlcu.data.sources", "from rlcu.rewards.math import MathAnswer"),
    ("rlcu.contracts", "from rlcu.engine.sequence import Sequence"),
])
def test_an_injected_upward_import_is_caught(module, source):
    assert upward_imports(module, source), f"{source!r} in {module} was not flagged"


def test_downward_and_shared_imports_pass():
    assert not upward_imports("rlcu.grpo.module", "from rlcu import plugins\nfrom rlcu.models import load_model")
    assert not upward_imports("rlcu.engine.llm_engine", "from rlcu.contracts import SamplingParams")
    assert not upward_imports("rlcu.cli", "from rlcu.grpo.module import GRPOModule")
