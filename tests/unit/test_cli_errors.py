"""Bad input to `rlcu run` is one line that names the problem and the fix, with exit code 2: never a
traceback, a parser dump or a hang. Also: help that helps, rewards importable from the working folder,
and failed starts that leave no empty run folders behind."""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcu import cli
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

ROOT = str(Path(__file__).resolve().parents[2])

REWARDS = """
def one_float(completions, **kwargs):
    return 1.0

def always_nan(completions, **kwargs):
    return [float("nan")] * len(completions)

def length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny"), "llama", chat_template=CHAT_TEMPLATE)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A working folder with a rewards module (imported by path, as a TRL user would), data files and a file
    where a folder is expected (the stand-in for a read-only place: root may write anywhere)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "t1", "target": "t2"}\n{"prompt": "t3",\n')
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "t1", "target": "t2"}\n'
                                              '{"prompt": "t3 \\ud800", "target": "t2"}\n')
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path


ARGS = ["--model.max_prompt_length=64", "--model.max_completion_length=4", "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false", "--model.eval_at_start=false"]
RLCU = Path(sys.executable).parent / "rlcu"  # the console script, as a user runs it (not `python -m`)


def run(tiny, *extra):
    cli.main(["run", "quickstart", f"--model.model={tiny}", *ARGS, *extra])


def run_command(tiny, folder, *extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([str(RLCU), "run", "quickstart", f"--model.model={tiny}", *ARGS, *extra], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


BAD = {
    "negative max_steps": (["--trainer.max_steps=-5"], "max_steps"),
    "empty training file": (["--data.dataset=empty.jsonl", "--data.dataset_args=null"], "empty.jsonl is empty"),
    "malformed JSON Lines": (["--data.dataset=broken.jsonl", "--data.dataset_args=null"],
                             "broken.jsonl:2 is not valid JSON"),
    "a lone surrogate in JSON Lines": (["--data.dataset=surrogate.jsonl", "--data.dataset_args=null"],
                                       "surrogate.jsonl:2 holds \\ud800, half of a UTF-16 pair"),
    "a data file that does not exist": (["--data.dataset=nonexist.jsonl", "--data.dataset_args=null"],
                                        "nonexist.jsonl does not exist"),
    "a reward returning one float": (["--model.rewards=[my_rewards.one_float]"], "reward 'one_float' returned 1.0"),
    "a reward returning NaN every step": (["--model.rewards=[my_rewards.always_nan]", "--trainer.max_steps=4"],
                                          "3 updates in a row were skipped"),
    "a temperature of 0": (["--model.temperature=0"], "temperature must be > 0, got 0.0"),
    # no hub here; where there is one, the id names no repository: either way the download fails
    "a hub id that cannot be downloaded": (["--model.model=rlcu-tests/no-such-model"],
                                           "could not download 'rlcu-tests/no-such-model' from the Hugging Face hub"),
    "a misspelled option": (["--model.learning_rat=1e-5"], "did you mean --model.learning_rate?"),
    "an unwritable log folder": (["--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                                  "--trainer.logger.save_dir=a-file/runs"], "cannot write there"),
    "an unwritable checkpoint folder": (["--trainer.enable_checkpointing=true",
                                         "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                                         "--trainer.callbacks.dirpath=a-file/ckpt"],
                                        "the dirpath of ModelCheckpoint a-file/ckpt: cannot write there"),
    "a tensor-parallel size that does not divide the processes": (
        ["--trainer.strategy=rlcu.FSDP2Strategy", "--trainer.strategy.tensor_parallel_size=2"],
        "tensor_parallel_size=2 does not divide the 1 processes"),
}


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_code_2(name, tiny, folder):
    extra, says = BAD[name]
    done = run_command(tiny, folder, *extra)
    err = done.stderr
    errors = [line for line in err.splitlines() if line.startswith("rlcu: error:")]
    assert done.returncode == 2, err[-3000:]
    assert len(errors) == 1 and says in errors[0], err[-3000:]
    assert "Traceback" not in err and "usage:" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has the GPU asked for")
def test_a_gpu_asked_of_a_machine_without_one_is_one_line(tiny, folder, capsys):
    with pytest.raises(SystemExit) as e:
        run(tiny, "--trainer.accelerator=gpu")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--trainer.accelerator=gpu: torch sees no GPU on this machine" in err
    assert "--trainer.accelerator=cpu" in err and not list(folder.glob("runs/*/version_*"))


def test_disk_full_while_saving_is_one_line(tiny, folder, capsys, monkeypatch):
    import torch

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "ckpt" / "last.ckpt"))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SystemExit) as e:
        run(tiny, "--trainer.enable_checkpointing=true",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={folder / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=1")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rlcu: error:")]
    assert e.value.code == 2 and len(errors) == 1 and "No space left on device" in errors[0], err[-3000:]


@pytest.mark.parametrize("command", ["run", "eval"])
def test_help_prints_help(command, capsys):
    cli.main([command, "--help"])  # returns: exit code 0
    out = capsys.readouterr().out
    assert f"usage: rlcu {command} RECIPE" in out and "quickstart" in out


def test_a_reward_by_import_path_from_the_working_folder_runs(tiny, folder):
    """A TRL-style function in ./my_rewards.py, named by import path, as `python -m` would find it."""
    done = run_command(tiny, folder, "--model.rewards=[my_rewards.length]", "--trainer.logger=false",
                       "--trainer.callbacks=[]")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failed_start_leaves_no_empty_run_folder(tiny, folder, capsys):
    with pytest.raises(SystemExit):
        run(tiny, "--data.dataset=empty.jsonl", "--data.dataset_args=null",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={folder / 'runs'}")
    assert not list((folder / "runs").rglob("version_*")), "an empty version folder was left behind"


def test_a_run_that_fails_in_its_first_step_leaves_no_folder(tiny, folder, capsys):
    """A reward that fails the first step: the wandb run, its links (latest-run, debug logs) and the folders made
    for them go, as the empty version folder does."""
    with pytest.raises(SystemExit):
        run(tiny, "--model.rewards=[my_rewards.one_float]")
    assert "reward 'one_float' returned 1.0" in capsys.readouterr().err
    assert not (folder / "runs").exists(), sorted(str(p) for p in (folder / "runs").rglob("*"))


def test_a_start_that_fails_to_build_the_model_leaves_no_folder(tiny, folder, capsys):
    """The output folders are checked before anything starts, and the check takes back what it made: an unknown
    reward (the module fails to build) leaves no empty runs/ (the default wandb logger's) in the working folder."""
    with pytest.raises(SystemExit):
        run(tiny, "--model.rewards=[no_such_reward]", f"--trainer.logger.save_dir={folder / 'out' / 'runs'}")
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err
    assert not (folder / "out").exists()


def test_the_progress_bar_says_no_negative_epoch(tiny, folder, capsys):
    run(tiny, "--trainer.enable_progress_bar=true", "--trainer.logger=false", "--trainer.callbacks=[]")
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "Epoch 0" in shown and "/-2" not in shown

