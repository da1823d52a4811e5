"""The reward contract, compatible with TRL's GRPOTrainer so TRL users' functions run unchanged:

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

`columns` are the dataset's other columns, one value per completion, plus `trainer_state`. `None`
means "not applicable to this sample". Class-style rewards subclass `Reward` to carry a name, a
weight and constructor arguments. Scoring validates every output and names the reward and the
sample when something is wrong (`scoring.py` calls them)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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


# TRL's reward functions (and factories, given `init_args`) by their short names, where no plugin claims the name
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_cosine_scaled_reward",
               "get_repetition_penalty_reward", "get_soft_overlong_punishment")


def _trl_name(spec):
    """`spec` with a TRL reward's short name as its import path in `trl.rewards`."""
    name = spec.get("name") if isinstance(spec, dict) else spec
    if not isinstance(name, str) or name not in TRL_REWARDS or name in plugins.available("rewards"):
        return spec
    path = f"trl.rewards:{name}"
    return dict(spec, name=path) if isinstance(spec, dict) else path


def _reward_model(spec, tokenizer):
    """A reward model for a spec that names one (a folder of a sequence classifier, a hub id that is no plugin or
    import path) or is one (a transformers model object), else None."""
    from rlcu.rewards.model import RewardModel, is_reward_model_folder

    if isinstance(spec, torch.nn.Module):
        return RewardModel(spec, tokenizer)
    if not isinstance(spec, str) or spec in plugins.available("rewards") or ":" in spec:
        return None
    if is_reward_model_folder(spec):
        return RewardModel(spec, tokenizer)
    if spec.count("/") == 1 and not Path(spec).exists() and not spec.startswith((".", "/", "~")):
        try:
            plugins.import_path(spec)
        except (ImportError, AttributeError, ValueError):
            return RewardModel(spec, tokenizer)  # an owner/name hub id
    return None


def resolve_reward(spec, tokenizer=None) -> BoundReward:
    """A reward from a callable, a `Reward`, a short name / import path (TRL's reward names included), or a mapping
    {name | class_path: ..., weight: ..., init_args: {...}}; with `init_args` the target is a class or a factory
    (TRL's `get_soft_overlong_punishment`, say), called with them to make the reward."""
    model = _reward_model(spec, tokenizer)
    if model is not None:
        return BoundReward(model, model.name, 1.0)
    if tokenizer is not None:
        raise ValueError(f"a reward processing class was given for {spec!r}, which is not a reward model")
    fn, extras = plugins.build("rewards", _trl_name(spec), extra_keys=("weight",))
    if not callable(fn):
        raise TypeError(f"a reward must be callable, got {type(fn).__name__}")
    weight = extras.get("weight", getattr(fn, "weight", 1.0))
    return BoundReward(fn, _name_of(fn), float(weight))


def resolve_rewards(specs, weights: list[float] | None = None, extra: list[BoundReward] = (),
                    processing_classes=None) -> list[BoundReward]:
    """The rewards of `specs` with `weights`, then `extra` ones that carry their own (an environment's).
    `processing_classes`: TRL's `reward_processing_classes`, the tokenizers of reward models given as objects
    (one, or one per reward with None for the others)."""
    specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    if not specs and not extra:
        raise ValueError("at least one reward is needed (or an environment that defines get_reward)")
    tokenizers = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes] * len(
        specs)
    if len(tokenizers) != len(specs):
        raise ValueError(f"reward_processing_classes has {len(tokenizers)} entries for {len(specs)} rewards")
    bound = [resolve_reward(s, t) for s, t in zip(specs, tokenizers)]
    if weights is not None:
        if len(weights) != len(bound):
            raise ValueError(f"reward_weights has {len(weights)} value(s) for {len(bound)} reward(s) "
                             f"({', '.join(b.name for b in bound)}): give one weight a reward, in that order, or "
                             "leave reward_weights unset (each reward's own weight, 1.0 by default)")
        for b, w in zip(bound, weights):
            b.weight = float(w)
    bound += list(extra)
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


def require_column(reward: str, name: str, kwargs: dict) -> list:
    if name not in kwargs:
        cols = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric"))
        raise KeyError(f"reward {reward!r} needs the dataset column {name!r}; the batch has {cols}: add that "
                       f"column to the data, or choose a reward that does not need it")
    return kwargs[name]


def checked_format_score(format_score: float) -> float:
    """TinyZero's partial credit for a wrong answer in the asked format: below a right answer's 1."""
    if not 0.0 <= format_score < 1.0:
        raise ValueError(f"format_score must be in [0, 1) (a right answer scores 1), got {format_score}")
    return format_score
