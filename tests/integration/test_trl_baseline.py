"""The arithmetic recipe's TRL script runs (one step, tiny model, CPU) and writes its CSV."""
import csv
import importlib.util
from pathlib import Path

import pytest

from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "arithmetic" / "trl_baseline.py"


@pytest.mark.slow
def test_trl_baseline_runs_one_step(tmp_path):
    pytest.importorskip("trl")
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=64, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    spec = importlib.util.spec_from_file_location("trl_baseline", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "trl.csv"
    rows = script.main(["--out", str(out), "--max_steps", "1", "--model", str(model)])
    assert len(rows) == 1 and rows[0]["step"] == 1
    written = list(csv.DictReader(open(out)))[0]
    assert written["reward"] == str(rows[0]["reward"])
    assert written["rewards/math_answer/mean"] and written["rewards/overlong_penalty/mean"]  # the recipe's two rewards


@pytest.mark.slow
def test_trl_baseline_loads_the_recipes_embedded_model(tmp_path, smollm2_folder):
    """The recipe's own model (SmolLM2 converted from GGUF) through TRL's GRPOTrainer, one step on the CPU."""
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_baseline", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["--out", str(tmp_path / "trl.csv"), "--max_steps", "1", "--batch_size", "4",
                        "--num_generations", "2"])  # a smaller step than the recipe's 16 x 8: the same code path
    assert len(rows) == 1 and rows[0]["rewards/math_answer/mean"] is not None


@pytest.mark.slow
def test_trl_baseline_runs_the_calculator_recipe_with_its_tool(tmp_path, smollm2_folder):
    """TRL's GRPOTrainer(tools=[calculator]) on the calculator recipe, one step on the CPU."""
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_baseline_all", SCRIPT.parents[1] / "trl_baseline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["calculator", "--out", str(tmp_path / "trl.csv"), "--max_steps", "1", "--batch_size", "2",
                        "--num_generations", "2", "--max_completion_length", "48"])
    assert len(rows) == 1 and rows[0]["tools/call_frequency"] is not None
