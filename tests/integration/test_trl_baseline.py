"""The recipes' TRL script runs (one step, tiny model, CPU) and writes its CSV, with rlcu's held-out
evaluation of TRL's weights in it."""
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
    rows = script.main(["--out", str(out), "--max_steps", "1", "--model", str(model), "--eval_every", "1"])
    train = [r for r in rows if "reward" in r]
    assert len(train) == 1 and train[0]["step"] == 1
    written = [r for r in csv.DictReader(open(out)) if r["reward"]][0]
    assert written["reward"] == str(train[0]["reward"])
    assert written["rewards/math_answer/mean"] and written["rewards/overlong_penalty/mean"]  # the recipe's two rewards
    held_out = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in held_out] == [0, 1]  # before training and after the step


def direct_evaluation(folder, rows: list[dict]) -> dict:
    """rlcu's own held-out evaluation of a model folder with the arithmetic recipe's options."""
    import yaml

    from rlcu.grpo.evaluation import evaluate_all
    from rlcu.grpo.module import GRPOModule

    recipe = yaml.safe_load(open(SCRIPT.parent / "config.yaml"))
    module = GRPOModule(**{**recipe["model"], "model": str(folder), "eval_num_samples": 0})
    module.setup("validate")
    return evaluate_all(module, rows, 16)


@pytest.mark.slow
def test_trl_baseline_loads_the_recipes_embedded_model(tmp_path, smollm2_folder):
    """The recipe's own model (SmolLM2 converted from GGUF) through TRL's GRPOTrainer, one step on the CPU."""
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_baseline", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # a smaller step than the recipe's 16 x 8: the same code path
    rows = script.main(["--out", str(tmp_path / "trl.csv"), "--max_steps", "1", "--batch_size", "4",
                        "--num_generations", "2", "--eval_every", "0"])
    assert len(rows) == 1 and rows[0]["rewards/math_answer/mean"] is not None


@pytest.mark.slow
def test_trl_side_held_out_evaluation_is_rlcus_on_the_same_weights(smollm2_folder):
    """The TRL side's held-out figures come from TRL's model object through a saved copy: for the embedded
    SmolLM2 as transformers loads it, they equal rlcu's evaluation of the model folder itself."""
    import yaml
    from transformers import AutoModelForCausalLM

    from rlcu.data.module import PromptDataModule

    spec = importlib.util.spec_from_file_location("trl_baseline", SCRIPT.parents[1] / "trl_baseline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    recipe = yaml.safe_load(open(SCRIPT.parent / "config.yaml"))
    dm = PromptDataModule(**recipe["data"])
    dm.setup()
    rows = dm.val_set[:16]
    weights = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    via_trl = script.held_out_metrics(weights, str(smollm2_folder), recipe["model"], rows, 16)
    direct = direct_evaluation(smollm2_folder, rows)
    assert 0 < direct["eval/mean_length"] < 16, "every completion the same length: the check would be weak"
    assert via_trl == pytest.approx(direct, abs=1e-6)


@pytest.mark.slow
def test_trl_baseline_runs_the_calculator_recipe_with_its_tool(tmp_path, smollm2_folder):
    """TRL's GRPOTrainer(tools=[calculator]) on the calculator recipe, one step on the CPU."""
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_baseline_all", SCRIPT.parents[1] / "trl_baseline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["calculator", "--out", str(tmp_path / "trl.csv"), "--max_steps", "1", "--batch_size", "2",
                        "--num_generations", "2", "--max_completion_length", "48", "--eval_every", "0"])
    assert len(rows) == 1 and rows[0]["tools/call_frequency"] is not None


def test_curves_plot_both_held_out_accuracies(tmp_path, monkeypatch):
    """recipes/curves.py draws rlcu's and TRL's held-out accuracy where TRL's CSV has it."""
    import matplotlib.axes

    spec = importlib.util.spec_from_file_location("curves", SCRIPT.parents[1] / "curves.py")
    curves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curves)
    (tmp_path / "rlcu.csv").write_text("step,timing/elapsed,reward,eval/accuracy\n0,,,0.1\n1,2.0,0.5,\n2,4.0,0.7,0.4\n")
    (tmp_path / "trl.csv").write_text("step,seconds,reward,eval/accuracy\n0,0.0,,0.1\n1,20.0,0.4,\n2,40.0,0.6,0.3\n")
    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, x, y, **kw: drawn.append((kw["label"], list(y)))
                        or real(ax, x, y, **kw))
    curves.main([str(tmp_path / "rlcu.csv"), "--trl", str(tmp_path / "trl.csv"), "--out", str(tmp_path / "c.png")])
    assert ("rlcu", [0.1, 0.4]) in drawn and ("TRL", [0.1, 0.3]) in drawn
    assert (tmp_path / "c.png").stat().st_size > 0


def test_options_passed_to_trl_by_name_mean_the_same_on_both_sides():
    """Each option the TRL script copies by name is a GRPOModule argument and a GRPOConfig field."""
    pytest.importorskip("trl")
    import dataclasses
    import inspect

    from trl import GRPOConfig

    from rlcu.grpo.module import GRPOModule

    spec = importlib.util.spec_from_file_location("trl_baseline_names", SCRIPT.parents[1] / "trl_baseline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    ours = set(inspect.signature(GRPOModule).parameters)
    assert set(script.SAME_NAMES) <= fields & ours
