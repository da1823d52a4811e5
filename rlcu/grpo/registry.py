"""Loss types and advantage estimators as registered records, not string branches (verl's
`register_policy_loss` / `register_adv_est` are the model). The built-ins register in `loss.py`; a plugin
registers more with the decorators below, or ships a record under the `rlcu.losses` entry-point group:

    [project.entry-points."rlcu.losses"]
    my_loss = "my_pkg.losses:MY_LOSS"          # a LossType or an AdvantageEstimator

A record's name is what `loss_type:` / `advantage_estimator:` take."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlcu import plugins


@dataclass
class PolicyTerms:
    """What a surrogate sees of one micro-batch; [B, T] per token, [B, 1] per sequence."""
    logps: torch.Tensor  # log pi of the sampled tokens (with gradient)
    log_ratio: torch.Tensor  # log pi - log pi_old per token
    coef: torch.Tensor  # the importance weight w = pi / pi_old (per token, or GSPO's per sequence)
    advantages: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # 0/1 over completion tokens with loss
    epsilon_low: float
    epsilon_high: float
    options: object  # loss.LossOptions: the newer losses' settings
    sampling_ratio: torch.Tensor | None  # pi_old / pi_sampler after truncation or masking (None: off)


# (masked per-token loss, mask, max_completion_length, num_micro_batches, num_items_in_batch) -> the micro-batch's
# share of the step loss
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, int, "float | torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class LossType:
    name: str
    surrogate: Callable[[PolicyTerms], torch.Tensor]  # the policy term per token ([B, T]) or sequence ([B, 1])
    aggregation: Aggregation
    needs_num_items: bool = False  # the aggregation divides by the completion tokens of the whole step
    preferred_level: str | None = None  # the importance_sampling_level the loss is meant with (a warning if not)
    takes_sampling_ratio: bool = False  # the surrogate folds the sampler correction in itself (not multiplied after)
    help: str = ""


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    advantages: Callable[[torch.Tensor, int, str], torch.Tensor]  # (rewards [N], G, scale_rewards) -> [N]
    help: str = ""


LOSSES: dict[str, LossType] = {}
ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register(record: LossType | AdvantageEstimator) -> LossType | AdvantageEstimator:
    if not isinstance(record, (LossType, AdvantageEstimator)):
        raise TypeError(f"a {plugins.GROUPS['losses']} entry must be a LossType or an AdvantageEstimator, got "
                        f"{type(record).__name__}")
    table = LOSSES if isinstance(record, LossType) else ESTIMATORS
    if record.name in table and table[record.name] != record:
        raise ValueError(f"{type(record).__name__} {record.name!r} is registered already")
    table[record.name] = record
    return record


def register_loss(name: str, aggregation: Aggregation, **fields) -> Callable:
    """Decorator: `@register_loss("my_loss", aggregation=token_mean)` over a surrogate `fn(PolicyTerms)`."""
    def wrap(surrogate):
        register(LossType(name, surrogate, aggregation, **fields))
        return surrogate
    return wrap


def register_advantage_estimator(name: str, help: str = "") -> Callable:
    """Decorator: `@register_advantage_estimator("my_adv")` over `fn(rewards [N], G, scale) -> [N]`."""
    def wrap(fn):
        register(AdvantageEstimator(name, fn, help))
        return fn
    return wrap


def _lookup(table: dict, name, kind: str, option: str):
    if isinstance(name, (LossType, AdvantageEstimator)):
        return name
    from rlcu.grpo import loss  # noqa: F401  (registers the built-ins)

    if name not in table:
        for ep_name, ep in plugins.available("losses").items():
            if ep_name == name:
                register(ep.load())
    if name not in table:
        raise ValueError(f"{option} must be one of {tuple(table)} (or a {kind} that a package registers under the "
                         f"'{plugins.GROUPS['losses']}' entry-point group), got {name!r}")
    return table[name]


def loss_type(name: str | LossType) -> LossType:
    return _lookup(LOSSES, name, "loss type", "loss_type")


def advantage_estimator(name: str | AdvantageEstimator) -> AdvantageEstimator:
    return _lookup(ESTIMATORS, name, "advantage estimator", "advantage_estimator")


def builtin() -> tuple[dict[str, LossType], dict[str, AdvantageEstimator]]:
    from rlcu.grpo import loss  # noqa: F401

    return dict(LOSSES), dict(ESTIMATORS)
