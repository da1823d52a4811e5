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
        assert marker.exists(), f"the reward was never reached: {proc.communicate(timeout=5)[1][-2000:]}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "hangs_forever" in err
