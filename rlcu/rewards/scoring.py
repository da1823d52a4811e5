"""Calling the rewards of a batch: validate what they return, run `async def` rewards concurrently,
bound each call by a timeout, and decide what a failing reward does.

`on_error="raise"` stops with an error that names the reward and the first sample that fails alone;
`on_error="none"` scores the samples that fail (raise or time out alone) as None, "not applicable",
and keeps going. NaN or Inf is a numerical fault (`NonFiniteReward`), which the GRPO module turns into
a skipped update. A timed-out synchronous reward cannot be stopped from Python: it is left running in
a background thread, and its result is ignored."""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math

import torch

from rlcu.rewards.base import BoundReward, NonFiniteReward, RewardError, _preview

log = logging.getLogger(__name__)
ON_ERROR = ("raise", "none")
FLOAT32_MAX = torch.finfo(torch.float32).max


class RewardTimeout(TimeoutError):
    pass


def score(rewards: list[BoundReward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], timeout: float | None = None, on_error: str = "raise", **context) -> torch.Tensor:
    """[N, R] float32 rewards, NaN where a reward returned None (or failed, under on_error='none')."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_reward_error must be one of {ON_ERROR}, got {on_error!r}")
    n = len(completions)
    kwargs = dict(columns, **context)
    batch = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    results = _call_all(rewards, batch, timeout)
    out = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, (r, result) in enumerate(zip(rewards, results)):
        if isinstance(result, BaseException):
            what = (f"did not return within {timeout} s" if isinstance(result, RewardTimeout)
                    else f"raised {type(result).__name__}: {result}")
            if on_error == "raise":
                raise RewardError(f"reward {r.name!r} {what}{_locate_failure(r, batch, n, timeout)}") from result
            result = [_one_or_none(r, _sample(batch, i, n), timeout) for i in range(n)]
            log.warning("reward %r %s; %d of %d samples scored None", r.name, what, sum(v is None for v in result), n)
        out[:, j] = torch.tensor(_validate(r, result, completions), dtype=torch.float32)
    return out


def _validate(r: BoundReward, values, completions) -> list[float]:
    n = len(completions)
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


def _call_all(rewards: list[BoundReward], batch: dict, timeout: float | None) -> list:
    """Each reward's values, or the exception it raised; async rewards run concurrently."""
    results: list = [None] * len(rewards)
    pending = {j: r for j, r in enumerate(rewards) if _is_async(r.fn)}
    if pending:
        async def gather():
            return await asyncio.gather(*(_bounded(r.fn(**batch), timeout) for r in pending.values()),
                                        return_exceptions=True)
        for j, value in zip(pending, asyncio.run(gather())):
            results[j] = value
    for j, r in enumerate(rewards):
        if j not in pending:
            results[j] = _call(r, batch, timeout)
    return results


def _call(r: BoundReward, batch: dict, timeout: float | None):
    if _is_async(r.fn):
        try:
            return asyncio.run(_bounded(r.fn(**batch), timeout))
        except Exception as e:
            return e
    if timeout is None:
        try:
            return r.fn(**batch)
        except Exception as e:
            return e
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{r.name}")
    future = pool.submit(r.fn, **batch)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return RewardTimeout(f"reward {r.name!r} timed out")
    except Exception as e:
        return e
    finally:
        pool.shutdown(wait=False)  # a hung call stays behind in its thread; nothing waits for it


async def _bounded(coroutine, timeout: float | None):
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except asyncio.TimeoutError:
        raise RewardTimeout("timed out") from None


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _sample(batch: dict, i: int, n: int) -> dict:
    return {k: (v[i:i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in batch.items()}


def _one_or_none(r: BoundReward, one: dict, timeout: float | None):
    value = _call(r, one, timeout)
    if isinstance(value, BaseException) or value is None or len(list(value)) != 1:
        return None
    return list(value)[0]


def _locate_failure(r: BoundReward, batch: dict, n: int, timeout: float | None) -> str:
    """Re-run one sample at a time to name the first one that fails (rewards are batch functions)."""
    for i in range(n):
        if isinstance(_call(r, _sample(batch, i, n), timeout), BaseException):
            return (f" on sample {i} (prompt {_preview(batch['prompts'][i])!r}, "
                    f"completion {_preview(batch['completions'][i])!r})")
    return " (no single sample fails alone: the failure depends on the whole batch)"
