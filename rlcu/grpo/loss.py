"""GRPO maths as pure functions, with the published definitions and TRL's conventions:

- group advantages (DeepSeekMath GRPO) with scale `group | batch | none` (Dr. GRPO drops the scale);
- the clipped surrogate per token with `epsilon_low/high` (DAPO's clip-higher);
- the sequence-level importance ratio of GSPO;
- the k3 estimator of KL to a frozen reference (Schulman's approximation, used by GRPO);
- aggregation `grpo | bnpo | dr_grpo | dapo` of per-token losses into the micro-batch loss.

Tensors are [B, T] per token with a 0/1 `mask` over completion tokens, [B] per sequence."""
from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
LEVELS = ("token", "sequence")
STD_EPS = 1e-4  # TRL's: keeps a near-constant group from exploding its advantages


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaN (NaN where fewer than two values)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return var.sqrt().squeeze(dim)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, R] rewards (NaN = not applicable) -> [N] weighted sum; NaN where no reward applied."""
    total = (rewards_per_func * weights[None]).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N] rewards, N = prompts x G with each prompt's G completions adjacent.

    Returns (advantages, std, is_std_zero). Unscorable rows (NaN reward) are left out of their
    group's baseline and get advantage 0."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale!r}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), std, is_std_zero


def log_importance_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """log pi/pi_old per token [B, T], or GSPO's length-normalised sequence ratio [B, 1]."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {level!r}")


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi (>= 0)."""
    r = ref_logps - logps
    return torch.exp(r) - r - 1


def per_token_loss(logps, old_logps, advantages, mask, epsilon_low=0.2, epsilon_high=0.2, level="token",
                   ref_logps=None, beta=0.0):
    """Clipped surrogate -min(w A, clip(w, 1-eps_low, 1+eps_high) A) (+ beta * k3 KL).

    Returns (loss [B, T] or [B, 1], importance weight w, per-token KL or None)."""
    coef_1 = torch.exp(log_importance_weights(logps, old_logps, mask, level))
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    kl = None
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps)
        loss = loss + beta * kl
    return loss, coef_1, kl


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
                   num_micro_batches: int = 1, num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
    """The micro-batch's share of the step loss, so that gradients summed over micro-batches equal
    TRL's for the same step (the `/ num_micro_batches` is TRL's gradient-accumulation normaliser).

    grpo: mean over sequences of each sequence's token mean (DeepSeekMath).
    bnpo: token mean over the micro-batch.
    dr_grpo: token sum / (sequences x max_completion_length) (Dr. GRPO: no length bias).
    dapo: token sum / completion tokens in the whole step batch (`num_items_in_batch`)."""
    per_token = per_token.expand_as(mask) if per_token.shape != mask.shape else per_token
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / num_micro_batches
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    if loss_type == "dr_grpo":
        return masked.sum() / (mask.shape[0] * max_completion_length) / num_micro_batches
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type 'dapo' needs num_items_in_batch (completion tokens in the step batch)")
        return masked.sum() / torch.as_tensor(num_items_in_batch, dtype=masked.dtype).clamp(min=1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def clip_masks(coef_1: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float):
    """Where the clip is active: ratio below 1-eps with A<0 (low), above 1+eps with A>0 (high)."""
    adv = advantages.unsqueeze(1)
    low = (coef_1 < 1 - epsilon_low) & (adv < 0)
    high = (coef_1 > 1 + epsilon_high) & (adv > 0)
    return low, high, low | high
