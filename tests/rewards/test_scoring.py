"""Reward faults: a reward that raises or hangs stops with an error naming it and the sample, or (on
request) scores None for that sample; async rewards run concurrently; timeouts bound every call."""
import asyncio
import time

import pytest
import torch

from rlcu.rewards.base import RewardError, resolve_rewards
from rlcu.rewards.scoring import score

COMPLETIONS = ["fine", "hang", "boom", "fine too"]


def run(fns, **kw):
    return score(resolve_rewards(fns), ["p"] * 4, COMPLETIONS, [[1]] * 4, {}, **kw)


def hangs(completions, **kw):
    if "hang" in completions:
        time.sleep(1.5)
    return [1.0] * len(completions)


def raises(completions, **kw):
    if "boom" in completions:
        raise ZeroDivisionError("boom")
    return [float(len(c)) for c in completions]


def test_a_hanging_reward_is_named_with_its_sample():
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"'hangs' did not return within 0.2 s on sample 1 .*'hang'"):
        run([hangs], timeout=0.2)
    assert time.perf_counter() - start < 1.0, "the timeout did not bound the call"


def test_a_hanging_sample_scores_none_on_request():
    out = run([hangs], timeout=0.2, on_error="none")
    assert torch.isnan(out[1, 0]) and (out[[0, 2, 3], 0] == 1.0).all()


def test_a_raising_reward_is_named_or_scores_none():
    with pytest.raises(RewardError, match=r"'raises' raised ZeroDivisionError: boom on sample 2"):
        run([raises])
    out = run([raises], on_error="none")
    assert torch.isnan(out[2, 0]) and out[0, 0] == 4.0 and out[3, 0] == 8.0


def test_async_rewards_run_concurrently_and_time_out():
    async def slow_a(completions, **kw):
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_b(completions, **kw):
        await asyncio.sleep(0.4)
        return [2.0] * len(completions)

    start = time.perf_counter()
    out = run([slow_a, slow_b])
    assert time.perf_counter() - start < 0.75, "the two async rewards ran one after the other"
    assert (out[:, 0] == 1.0).all() and (out[:, 1] == 2.0).all()
    with pytest.raises(RewardError, match="'slow_a' did not return within 0.1 s"):
        run([slow_a], timeout=0.1)


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="on_reward_error must be one of"):
        run([raises], on_error="ignore")


def test_a_reward_that_never_returns_does_not_keep_the_process_alive(tmp_path):
    """A busy-looping reward past its timeout is left behind, and the process still exits at once (the
    reward's thread is a daemon: nothing joins it at exit)."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "from rlcu.rewards.base import resolve_rewards\nfrom rlcu.rewards.scoring import score\n"
        "def spins(completions, **kw):\n    while True:\n        pass\n"
        "out = score(resolve_rewards([spins]), ['p'], ['c'], [[1]], {}, timeout=0.3, on_error='none')\n"
        "print('scored', out.tolist())\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "scored [[nan]]" in done.stdout, done.stderr[-2000:]
    assert time.perf_counter() - start < 30, "the process waited for the hung reward at exit"


def test_a_stop_request_ends_the_wait_for_a_reward_without_timeout():
    from rlcu.rewards.scoring import RewardInterrupted

    asked = time.perf_counter() + 0.3
    start = time.perf_counter()
    with pytest.raises(RewardInterrupted, match="'hangs' was running"):
        score(resolve_rewards([hangs]), ["p"], ["hang"], [[1]], {}, timeout=None,
              stop_requested=lambda: time.perf_counter() > asked)
    assert time.perf_counter() - start < 1.2  # the reward itself sleeps 1.5 s


def test_the_default_reward_timeout_is_finite():
    import inspect

    from rlcu.grpo.module import GRPOModule

    default = inspect.signature(GRPOModule).parameters["reward_timeout"].default
    assert default is not None and 0 < default <= 600


def sleeps_on_every_sample(completions, **kw):
    time.sleep(1.0)
    return [1.0] * len(completions)


def test_a_reward_that_hangs_on_every_sample_costs_two_timeouts_not_one_a_sample():
    start = time.perf_counter()
    out = score(resolve_rewards([sleeps_on_every_sample]), ["p"] * 16, ["c"] * 16, [[1]] * 16, {}, timeout=0.2,
                on_error="none")
    assert torch.isnan(out).all()
    assert time.perf_counter() - start < 0.2 * 2 + 0.5  # the batch call, then all 16 samples side by side
    with pytest.raises(RewardError, match="did not return within 0.2 s on sample 0"):
        score(resolve_rewards([sleeps_on_every_sample]), ["p"] * 16, ["c"] * 16, [[1]] * 16, {}, timeout=0.2)


def spins(completions, **kw):
    if "hang" in completions:
        while True:
            pass
    return [float(len(c)) for c in completions]


def test_process_isolation_kills_a_reward_past_its_timeout():
    import multiprocessing
    import threading

    # a timeout a forked child meets on a busy 2-core machine (0.5 s missed one there; the spinning one costs 2 x 3 s)
    out = run([spins], timeout=3.0, on_error="none", isolation="process")
    assert torch.isnan(out[1, 0]) and out[0, 0] == 4.0 and out[3, 0] == 8.0  # computed in the child, sent back
    assert not [t for t in threading.enumerate() if "spins" in t.name]  # no thread left spinning
    assert not multiprocessing.active_children()  # and no process
    with pytest.raises(RewardError, match="raised ZeroDivisionError: boom on sample 2"):
        run([raises], isolation="process")  # the child's exception comes back as it was raised
    with pytest.raises(ValueError, match="reward_isolation must be one of"):
        run([raises], isolation="subinterpreter")
