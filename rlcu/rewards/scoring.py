"""Calling the rewards of a batch: validate what they return, run `async def` rewards concurrently,
bound each call by a timeout, and decide what a failing reward does.

`on_error="raise"` stops with an error that names the reward and the first sample that fails alone;
`on_error="none"` scores the samples that fail (raise or time out alone) as None, "not applicable",
and keeps going. Either way the samples are retried one by one, side by side, within one more `timeout` in
all (a reward that hangs on every sample costs two timeouts a step, not one a sample). NaN or Inf is a
numerical fault (`NonFiniteReward`), which the GRPO module turns into a skipped update.

Each call is bounded as `rlcu/calls.py` bounds user code (a daemon thread, or an event loop for `async
def`; with `isolation="process"`, a forked process that the timeout kills); `stop_requested` (the trainer's
SIGTERM flag) is checked while waiting, so a hung reward does not keep a run from stopping."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from rlcu.calls import ISOLATION, CallInterrupted, CallTimeout, bounded, call_bounded, call_in_process, is_async
from rlcu.rewards.base import BoundReward, NonFiniteReward, RewardError, _preview

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "none")
RETRY_WORKERS = 32  # samples retried at once after a batch call failed
FLOAT32_MAX = torch.finfo(torch.float32).max


class RewardInterrupted(RuntimeError):
    """The run was asked to stop (SIGTERM) while a reward was still running."""


def score(rewards: list[BoundReward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], timeout: float | None = None, on_error: str = "raise",
          stop_requested: Callable[[], bool] | None = None, isolation: str = "thread", **context) -> torch.Tensor:
    """[N, R] float32 rewards, NaN where a reward returned None (or failed, under on_error='none')."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_reward_error must be one of {ON_ERROR}, got {on_error!r}")
    if isolation not in ISOLATION:
        raise ValueError(f"reward_isolation must be one of {ISOLATION}, got {isolation!r}")
    n = len(completions)
    kwargs = dict(columns, **context)
    batch = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    call = call_in_process if isolation == "process" else call_bounded
    results = _call_all(rewards, batch, timeout, stop_requested, call)
    out = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, (r, result) in enumerate(zip(rewards, results)):
        if isinstance(result, BaseException):
            what = (f"did not return within {timeout} s" if isinstance(result, CallTimeout)
                    else f"raised {type(result).__name__}: {result}")
            alone = _one_by_one(r, batch, n, timeout, stop_requested, call)
            if on_error == "raise":
                fix = "raise reward_timeout" if isinstance(result, CallTimeout) else "fix the reward"
                raise RewardError(f"reward {r.name!r} {what}{_first_failure(alone, batch)}; {fix}, or set "
                                  "on_reward_error: none to score such samples None") from result
            result = [None if isinstance(v, BaseException) or v is None or len(list(v)) != 1 else list(v)[0]
                      for v in alone]
            log.warning("reward %r %s; %d of %d samples scored None", r.name, what, sum(v is None for v in result), n)
        out[:, j] = torch.tensor(_validate(r, result, completions), dtype=torch.float32)
    return out


def _validate(r: BoundReward, values, completions) -> list[float]:
    n = len(completions)
    if values is not None and (isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__")):
        raise RewardError(f"reward {r.name!r} returned {_preview(values)} ({type(values).__name__}) for {n} "
                          "completions; it must return a list with one float (or None) per completion")
    values = list(values) if values is not None else None
    if values is None or len(values) != n:
        got = "None" if values is None else f"{len(values)} values"
        raise RewardError(f"reward {r.name!r} returned {got} for {n} completions; it must return one "
                          "float (or None for 'not applicable') per completion")
    floats = []
    for i, v in enumerate(values):
        if v is None:
            floats.append(float("nan"))
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward {r.name!r} returned {v!r} for sample {i}; expected a float or None") from None
        if not math.isfinite(f) or abs(f) > FLOAT32_MAX:  # rewards are float32 tensors: 1e39 would be inf
            raise NonFiniteReward(f"reward {r.name!r} returned {f} for sample {i} (completion "
                                  f"{_preview(completions[i])!r}); return None when a reward does not apply")
        floats.append(f)
    return floats


def _call_all(rewards: list[BoundReward], batch: dict, timeout: float | None,
              stop_requested: Callable[[], bool] | None = None, call=call_bounded) -> list:
    """Each reward's values, or the exception it raised; async rewards run concurrently."""
    results: list = [None] * len(rewards)
    pending = {j: r for j, r in enumerate(rewards) if is_async(r.fn)}
    if pending:
        async def gather():
            return await asyncio.gather(*(bounded(r.fn(**batch), timeout) for r in pending.values()),
                                        return_exceptions=True)
        for j, value in zip(pending, asyncio.run(gather())):
            results[j] = value
    for j, r in enumerate(rewards):
        if j not in pending:
            results[j] = _call(r, batch, timeout, stop_requested, call)
    return results


def _call(r: BoundReward, batch: dict, timeout: float | None, stop_requested: Callable[[], bool] | None = None,
          call=call_bounded):
    try:
        return call(r.fn, batch, timeout, f"reward {r.name!r}", stop_requested)
    except CallInterrupted as e:
        raise RewardInterrupted(f"the run was asked to stop while reward {r.name!r} was running") from e


def _sample(batch: dict, i: int, n: int) -> dict:
    return {k: (v[i:i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in batch.items()}


def _one_by_one(r: BoundReward, batch: dict, n: int, timeout: float | None, stop_requested, call) -> list:
    """Each sample's values (or exception) alone, side by side, all within one `timeout` from now: a sample not
    done by then times out."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def one(i: int):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return CallTimeout(f"reward {r.name!r} timed out")
        return _call(r, _sample(batch, i, n), left, stop_requested, call)

    if is_async(r.fn) or n == 1:
        return [one(i) for i in range(n)]
    with ThreadPoolExecutor(min(n, RETRY_WORKERS), thread_name_prefix="rlcu-reward") as pool:
        return list(pool.map(one, range(n)))


def _first_failure(alone: list, batch: dict) -> str:
    """Where a batch call failed: the first sample that fails alone (rewards are batch functions)."""
    for i, value in enumerate(alone):
        if isinstance(value, BaseException):
            return (f" on sample {i} (prompt {_preview(batch['prompts'][i])!r}, "
                    f"completion {_preview(batch['completions'][i])!r})")
    return " (no single sample fails alone: the failure depends on the whole batch)"
