"""The reward contract, compatible with TRL's GRPOTrainer so TRL users' functions run unchanged:

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

`columns` are the dataset's other columns, one value per completion, plus `trainer_state`. `None`
means "not applicable to this sample". Class-style rewards subclass `Reward` to carry a name, a
weight and constructor arguments. Scoring validates every output and names the reward and the
sample when something is wrong."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlcu import plugins


class Reward:
    """Base for class-style rewards: set `name` (defaults to the class name), implement `__call__`."""
    name: str | None = None
    weight: float = 1.0

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float | None]:
        raise NotImplementedError


class RewardError(RuntimeError):
    pass


class NonFiniteReward(RewardError):
    """A reward returned NaN or Inf: a numerical fault; the GRPO module skips that update."""


@dataclass
class BoundReward:
    fn: Callable
    name: str
    weight: float


def completion_text(completion: Any) -> str:
    """The text of a completion, whether plain or conversational ([{'role': 'assistant', 'content': ...}])."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")


def _name_of(fn) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def resolve_reward(spec) -> BoundReward:
    """A reward from a callable, a `Reward`, a short name / import path, or a mapping
    {name | class_path: ..., weight: ..., init_args: {...}}."""
    fn, extras = plugins.build("rewards", spec, extra_keys=("weight",))
    if not callable(fn):
        raise TypeError(f"a reward must be callable, got {type(fn).__name__}")
    weight = extras.get("weight", getattr(fn, "weight", 1.0))
    return BoundReward(fn, _name_of(fn), float(weight))


def resolve_rewards(specs, weights: list[float] | None = None) -> list[BoundReward]:
    specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    if not specs:
        raise ValueError("at least one reward is needed")
    bound = [resolve_reward(s) for s in specs]
    if weights is not None:
        if len(weights) != len(bound):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(bound)} rewards")
        for b, w in zip(bound, weights):
            b.weight = float(w)
    names = [b.name for b in bound]
    if len(set(names)) != len(names):
        raise ValueError(f"two rewards share a name in {names}; give one a 'name' so their metrics differ")
    return bound


def _preview(x, n=80) -> str:
    try:
        s = completion_text(x)
    except TypeError:
        s = str(x)
    return (s[:n] + "...") if len(s) > n else s


def score(rewards: list[BoundReward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], **context) -> torch.Tensor:
    """[N, R] float32 rewards, NaN where a reward returned None."""
    n = len(completions)
    out = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, r in enumerate(rewards):
        kwargs = dict(columns, **context)
        try:
            values = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        except Exception as e:
            raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e}"
                              f"{_locate_failure(r, prompts, completions, completion_ids, kwargs)}") from e
        values = list(values) if values is not None else None
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise RewardError(f"reward {r.name!r} returned {got} for {n} completions; it must return one "
                              "float (or None for 'not applicable') per completion")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = float("nan")
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"reward {r.name!r} returned {v!r} for sample {i}; expected a float or None") from None
            if not math.isfinite(f):
                raise NonFiniteReward(f"reward {r.name!r} returned {f} for sample {i} (completion "
                                  f"{_preview(completions[i])!r}); return None when a reward does not apply")
            out[i, j] = f
    return out


def _locate_failure(r: BoundReward, prompts, completions, completion_ids, kwargs) -> str:
    """Re-run one sample at a time to name the first one that fails (rewards are batch functions)."""
    for i in range(len(completions)):
        one = {k: (v[i:i + 1] if isinstance(v, list) and len(v) == len(completions) else v) for k, v in kwargs.items()}
        try:
            r.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], completion_ids=completion_ids[i:i + 1], **one)
        except Exception:
            return f" on sample {i} (prompt {_preview(prompts[i])!r}, completion {_preview(completions[i])!r})"
    return " (no single sample fails alone: the failure depends on the whole batch)"


def require_column(reward: str, name: str, kwargs: dict) -> list:
    if name not in kwargs:
        cols = sorted(k for k in kwargs if k != "trainer_state")
        raise KeyError(f"reward {reward!r} needs the dataset column {name!r}; the batch has {cols}")
    return kwargs[name]
