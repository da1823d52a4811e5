"""A run stuck in a reward that never returns still stops on SIGTERM, exits 143 as a signal death would,
and leaves no process behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stderr_after_kill(proc: subprocess.Popen) -> str:
    """The end of a run's stderr for a failure message: the run is killed first, since one that is still going
    (past the wait, or stuck) would never close its pipes."""
    proc.kill()
    return proc.communicate(timeout=30)[1][-2000:]


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_reward_hangs(tmp_path):
    model = tiny_hf_folder(tmp_path / "tiny", "llama", chat_template=CHAT_TEMPLATE)
    marker = tmp_path / "reward-reached"
    cmd = [sys.executable, "-m", "rlcu.cli", "run", "quickstart", f"--model.model={model}",
           "--model.max_completion_length=4", "--model.max_prompt_length=64", "--model.reward_timeout=null",
           "--model.rewards=[tests.helpers.hangs_forever]", "--model.eval_at_start=false", "--trainer.logger=false",
           "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]", "--trainer.max_steps=3"]
    env = dict(os.environ, RLCU_TEST_MARKER=str(marker), PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the reward was never reached: {stderr_after_kill(proc)}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "hangs_forever" in err


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_rollout_stops_the_run_within_seconds_and_it_resumes(tmp_path, stop):
    """A rollout of long completions (a vocabulary of 4096: the end token almost never comes) is stopped between
    two decode steps; the last finished step's checkpoint loads, and the run resumes from it."""
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=4096, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           max_position_embeddings=8192, chat_template=CHAT_TEMPLATE)
    ckpt = tmp_path / "ckpt"

    def run(*extra):
        return [sys.executable, "-m", "rlcu.cli", "run", "quickstart", f"--model.model={model}",
                "--model.max_prompt_length=64", "--model.eval_at_start=false", "--trainer.logger=false",
                "--model.micro_batch_size=1", "--trainer.enable_progress_bar=false",
                "--trainer.enable_checkpointing=true", "--trainer.callbacks=[]",
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                f"--trainer.callbacks.dirpath={ckpt}",
                "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
                "--trainer.callbacks+=rlcu.callbacks.SaveOnInterrupt", f"--trainer.callbacks.dirpath={ckpt}", *extra]

    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(run("--model.max_completion_length=3000", "--trainer.max_steps=3"), cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # the first step: 16 completions of about 3000 tokens, and training
        while not list(ckpt.glob("*step=1.ckpt")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(ckpt.glob("*step=1.ckpt")), f"no first step: {stderr_after_kill(proc)}"
        time.sleep(5)  # 5 s into the second step's rollout (16 completions of up to 3000 tokens: about 50 s here)
        sent = time.monotonic()
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop, err[-2000:]
    print(f"{stop.name}: {took:.1f} s from the signal to the exit")
    assert took < 10, f"{took:.1f} s from the signal to the exit"
    assert f"stopped by {stop.name}" in err and "asked to stop while the rollout was decoding" in err
    assert "resume with --ckpt_path" in err
    resumed = subprocess.run(run("--model.max_completion_length=8", "--trainer.max_steps=2",
                                 f"--ckpt_path={ckpt / 'interrupted.ckpt'}"),
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert list(ckpt.glob("*step=2.ckpt")), "the resumed run did not finish the interrupted step"
