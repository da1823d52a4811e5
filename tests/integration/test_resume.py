"""A run interrupted at step 3 and resumed from its checkpoint reproduces the uninterrupted run's
rewards and losses exactly: weights, optimizer, LR schedule, data position (mid-epoch, then across an
epoch boundary) and sampling seeds all come back."""
import csv
import json
import os
import signal
import warnings

import lightning.pytorch as L
import pytest

from rlcu import cli
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder, toy_rows


def metrics(folder) -> dict[int, dict]:
    rows = csv.DictReader(open(next(folder.glob("lightning_logs/version_0/metrics.csv"))))
    return {int(r["step"]): r for r in rows if r.get("reward")}


class StopAt(L.Callback):
    """Stands in for an interruption: the run, configured for more, stops after `step` steps."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalAt(L.Callback):
    """A scheduler's SIGTERM, or a user's Ctrl-C, arriving during step `step`."""

    def __init__(self, step: int, name: str):
        self.step, self.signum, self.sent = step, getattr(signal, name), False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("interruption", ["stop", "SIGTERM", "SIGINT"])
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one(tmp_path, monkeypatch, interruption):
    monkeypatch.chdir(tmp_path)
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_rows(20, seed=2)))  # 5 batches per epoch

    def run(name, steps, *extra):
        cli.main(["run", "quickstart", f"--model.model={model}", "--model.max_completion_length=4",
                  "--model.max_prompt_length=64", "--model.rewards=[tests.helpers.first_token_value]",
                  "--model.learning_rate=1e-2", "--model.lr_scheduler=linear", "--model.num_generations=4",
                  f"--data.dataset={data}", "--data.dataset_args=null", "--data.batch_size=4",
                  f"--trainer.max_steps={steps}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                  f"--trainer.logger.save_dir={tmp_path / name}", "--trainer.enable_progress_bar=false",
                  "--trainer.callbacks=[]", *extra])

    run("whole", 8)
    checkpoints = ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=rlcu.callbacks.SaveOnInterrupt",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}"]
    if interruption == "stop":
        run("first", 8, "--trainer.callbacks+=tests.integration.test_resume.StopAt", "--trainer.callbacks.step=3",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.filename=interrupted",
            "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=link")  # as the recipes save
        assert (tmp_path / "ckpt" / "last.ckpt").is_symlink()
    else:  # the step in progress finishes, a checkpoint is saved, the run stops with 143 (130) as a signal death would
        with pytest.raises(SystemExit) as stopped:
            run("first", 8, *checkpoints, "--trainer.callbacks+=tests.integration.test_resume.SignalAt",
                "--trainer.callbacks.step=3", f"--trainer.callbacks.name={interruption}")
        assert stopped.value.code == 128 + getattr(signal, interruption)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = "last.ckpt" if interruption == "stop" else "interrupted.ckpt"
        run("resumed", 8, f"--ckpt_path={tmp_path / 'ckpt' / saved}")
    resumable = not [w for w in caught if "not resumable" in str(w.message)]
    assert resumable, "Lightning thinks the data loader cannot resume"
    whole, first, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "first"), metrics(tmp_path / "resumed")
    assert sorted(first) == sorted(whole)[:3] and sorted(resumed) == sorted(whole)[3:], (sorted(first), sorted(resumed))
    for step, row in {**first, **resumed}.items():
        for key in ("reward", "loss", "learning_rate", "completions/mean_length"):
            assert row[key] == whole[step][key], f"step {step}: {key} {row[key]} != {whole[step][key]}"
    assert len({whole[s]["reward"] for s in whole}) > 1  # the run moved: equal rows are not trivially equal


def test_command_line_options_win_over_the_checkpoints(tmp_path, monkeypatch, capsys):
    """--model.* given with --ckpt_path used to be replaced by the checkpoint's saved values in silence."""
    monkeypatch.chdir(tmp_path)
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_rows(20, seed=2)))

    def run(name, steps, *extra):
        cli.main(["run", "quickstart", f"--model.model={model}", "--model.max_completion_length=4",
                  "--model.max_prompt_length=64", "--model.rewards=[tests.helpers.first_token_value]",
                  "--model.num_generations=4", f"--data.dataset={data}", "--data.dataset_args=null",
                  "--data.batch_size=4", f"--trainer.max_steps={steps}", "--trainer.enable_progress_bar=false",
                  "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                  f"--trainer.logger.save_dir={tmp_path / name}", "--trainer.callbacks=[]", *extra])

    run("first", 2, "--model.learning_rate=1e-2", "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path}",
        "--trainer.callbacks.filename=last")
    capsys.readouterr()
    run("resumed", 4, f"--ckpt_path={tmp_path / 'last.ckpt'}", "--model.learning_rate=3e-3",
        "--model.max_completion_length=3")
    assert "--model.learning_rate=0.003 overrides the checkpoint's 0.01" in capsys.readouterr().err
    resumed = metrics(tmp_path / "resumed")
    assert sorted(resumed) == [2, 3] or sorted(resumed) == [3, 4], sorted(resumed)
    assert [float(r["learning_rate"]) for r in resumed.values()] == pytest.approx([3e-3] * 2)
    assert all(float(r["completions/max_length"]) <= 3 for r in resumed.values())
