"""GRPO maths as pure functions, with the published definitions and TRL's conventions:

- group advantages (DeepSeekMath GRPO) with scale `group | batch | none` (Dr. GRPO drops the scale);
- the clipped surrogate per token with `epsilon_low/high` (DAPO's clip-higher);
- the sequence-level importance ratio of GSPO;
- the k3 estimator of KL to a frozen reference (Schulman's approximation, used by GRPO);
- aggregation `grpo | bnpo | dr_grpo | dapo` of per-token losses into the micro-batch loss;
- TRL 1.16's newer losses: CISPO (MiniMax-M1: clipped, detached importance weights times the logprob),
  SAPO (a sigmoid gate instead of a hard clip), LUSPO (GSPO's sequence loss summed over each sequence's
  tokens), VESPO (a Gamma weighting of the sequence-level ratio times the logprob);
- the entropy controls: the top-entropy token mask (Beyond the 80/20 Rule) and the entropy bonus with
  Skywork-OR1's adaptive coefficient;
- advantage estimators beside GRPO's group normalisation: RLOO's leave-one-out baseline and REINFORCE++'s
  batch-normalised advantages;
- the correction for a sampler whose logprobs differ from the trainer's (TRL's `vllm_importance_sampling_*`:
  truncated or masked importance weights, per token or per sequence) and DeepSeek-V3.2's off-policy
  sequence mask.

Tensors are [B, T] per token with a 0/1 `mask` over completion tokens, [B] per sequence."""
from __future__ import annotations

import math

import torch

from rlcu.grpo import registry
from rlcu.grpo.options import LEVELS, SAMPLING_CORRECTION_MODES, SCALES, LossOptions
from rlcu.grpo.registry import LossType, PolicyTerms, register_advantage_estimator

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
    std, is_std_zero = reward_spread(rewards, num_generations, scale)
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), std, is_std_zero


def normalize_then_sum(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `multi_objective_aggregation="normalize_then_sum"`: each reward normalised within its group, the
    weighted sum of those, then normalised over the batch. [N, R] rewards (NaN: not applicable) -> (advantages
    [N], is_std_zero [N]); a row no reward applied to gets advantage 0."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(mean)
    per_func = ((grouped - mean) / (std + STD_EPS)).view_as(rewards_per_func)
    rewards = combine_rewards(per_func, weights)
    spread = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (spread + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(spread, torch.zeros_like(spread))


def reward_spread(rewards: torch.Tensor, num_generations: int, scale: str = "group"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] the std each row's advantage is scaled by: its group's, or the batch's with scale "batch";
    [N] bool: that std is zero, i.e. the group (or batch) carries no signal)."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale!r}")
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    return std, torch.isclose(std, torch.zeros_like(std))


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
                   ref_logps=None, beta=0.0, loss_type: str | LossType = "grpo", options: LossOptions | None = None,
                   token_mask=None, sampling_ratio=None, keep_sequences=None):
    """The policy loss per token (+ beta * k3 KL), as TRL's `_compute_loss` forms it: the loss type's surrogate
    (a registered record, `registry.py`), then, in TRL's order, times `keep_sequences` (the off-policy mask,
    [B, 1]), `token_mask` (the top-entropy mask) and `sampling_ratio` (the sampler correction, [B, T] or [B, 1];
    a surrogate that takes it into its own weight, as VESPO's, gets it instead), before the KL is added.

    Returns (loss [B, T] or [B, 1], importance weight w, per-token KL or None)."""
    kind, options = registry.loss_type(loss_type), options or LossOptions()
    coef_1 = torch.exp(log_importance_weights(logps, old_logps, mask, level))
    terms = PolicyTerms(logps, logps - old_logps, coef_1, advantages.unsqueeze(1), mask, epsilon_low, epsilon_high,
                        options, sampling_ratio)
    loss = kind.surrogate(terms)
    if keep_sequences is not None:
        loss = loss * keep_sequences
    if token_mask is not None:
        loss = loss * token_mask
    if sampling_ratio is not None and not kind.takes_sampling_ratio:
        loss = loss * sampling_ratio
    kl = None
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps)
        if options.use_bias_correction_kl:
            kl = kl * coef_1
        loss = loss + beta * kl
    return loss, coef_1, kl


def clipped_surrogate(t: PolicyTerms) -> torch.Tensor:
    """PPO's clipped surrogate (GRPO, DAPO, ...): -min(w A, clip(w, 1-eps_low, 1+eps_high) A), w capped at
    `delta` if set (INTELLECT-2's two-sided clip)."""
    coef_2 = torch.clamp(t.coef, 1 - t.epsilon_low, 1 + t.epsilon_high)
    capped = torch.clamp(t.coef, max=t.options.delta) if t.options.delta is not None else t.coef
    return -torch.min(capped * t.advantages, coef_2 * t.advantages)


def cispo_surrogate(t: PolicyTerms) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(min(w, eps_high)) A log pi."""
    return -torch.clamp(t.coef, max=t.epsilon_high).detach() * t.advantages * t.logps


def sapo_surrogate(t: PolicyTerms) -> torch.Tensor:
    """SAPO: -(4 / tau) sigmoid(tau (w - 1)) A, with tau by the sign of A."""
    tau = torch.where(t.advantages > 0, t.options.sapo_temperature_pos, t.options.sapo_temperature_neg)
    return -(torch.sigmoid(tau * (t.coef - 1)) * 4 / tau) * t.advantages


def vespo_surrogate(t: PolicyTerms) -> torch.Tensor:
    """VESPO: -sg(phi(w_seq)) A log pi, phi the Gamma weight of the sequence ratio (`gamma_weights`)."""
    return -gamma_weights(t.advantages, t.log_ratio, t.mask, t.options, t.sampling_ratio) * t.advantages * t.logps


@torch.no_grad()
def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  options: LossOptions | None = None, sampling_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's phi(w) = e^lambda w^k e^(-lambda w) (so phi(1) = 1) of the sequence ratio w = exp(sum of the
    token log-ratios, each clamped to [-20, 20]), with (k, lambda) by the sign of A; [B, 1], no gradient.
    A `sampling_ratio` (the sampler correction, per token [B, T] or per sequence [B, 1]) multiplies w: log w
    += the sum of its clamped logs."""
    low, options = math.log(1e-8), options or LossOptions()
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampling_ratio is not None:
        seq = seq + torch.clamp(torch.log(sampling_ratio), low, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, low, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(positive, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def sampling_ratio(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                   mode: str = "sequence_mask", clip_min: float | None = None,
                   clip_max: float | None = 3.0) -> torch.Tensor:
    """The importance weight pi_old / pi_sampler of the sampled tokens (TRL's vLLM correction): per token
    ([B, T]) or per sequence (exp of the summed log-ratios, [B, 1]); `*_truncate` clamps it to [clip_min,
    clip_max], `*_mask` zeroes it outside (TIS and MIS). A sampler logprob of NaN (not known) counts as equal."""
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"importance sampling mode must be one of {SAMPLING_CORRECTION_MODES}, got {mode!r}")
    diff = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: keep a sequence ([B, 1] of 1.0) when its advantage is >= 0
    or its mean KL(sampler || policy) estimate, mean of log pi_sampler - log pi, is at most `threshold`."""
    kl = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The top-`quantile` of completion tokens by entropy (`top_entropy_quantile`; 1.0 keeps all): tokens at
    or above the (1 - quantile) quantile of the masked entropies; bool [B, T]."""
    valid = entropies[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(valid, 1 - quantile)
    return ((entropies * mask) >= threshold) & mask.bool()


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, num_micro_batches: int = 1) -> torch.Tensor:
    """The mean entropy over `mask`'s tokens (the loss subtracts entropy_coef times it), this micro-batch's share."""
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """Skywork-OR1's controller, once per optimizer step: up by `delta` while the entropy is at or below the
    target, down otherwise, within [low, high]."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


@register_advantage_estimator("grpo", "group normalisation (DeepSeekMath), scaled by scale_rewards")
def grpo_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    return group_advantages(rewards, num_generations, scale)[0]


@register_advantage_estimator("rloo", "leave-one-out baseline (RLOO)")
def rloo_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other G - 1 rewards of its group
    = G / (G - 1) (r_i - group mean). NaN (unscorable) rewards are left out of the baselines and get 0."""
    grouped = rewards.view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    others = (valid.sum(1, keepdim=True) - valid.long()).clamp(min=1)
    baseline = (total - torch.nan_to_num(grouped)) / others
    return torch.nan_to_num(grouped - baseline, nan=0.0).view(-1)


@register_advantage_estimator("reinforce_pp", "batch-normalised advantages (REINFORCE++)")
def reinforce_pp_advantages(rewards: torch.Tensor, num_generations: int = 1, scale: str = "batch") -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the reward's deviation from the batch mean over the batch's standard deviation
    (a global baseline and normalisation, no per-prompt group). NaN rewards get 0."""
    centred = rewards - torch.nanmean(rewards)
    std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
    return torch.nan_to_num(centred / (std + STD_EPS), nan=0.0)


def sequence_mean(masked, mask, max_completion_length, num_micro_batches, num_items_in_batch):
    """Mean over sequences of each sequence's token mean (DeepSeekMath)."""
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / num_micro_batches


def sequence_sum_mean(masked, mask, max_completion_length, num_micro_batches, num_items_in_batch):
    """Mean over sequences of each sequence's token sum (LUSPO: GSPO scaled by length)."""
    return masked.sum(-1).mean() / num_micro_batches


def token_mean(masked, mask, max_completion_length, num_micro_batches, num_items_in_batch):
    """Token mean over the micro-batch (BNPO)."""
    return masked.sum() / mask.sum().clamp(min=1.0) / num_micro_batches


def max_length_mean(masked, mask, max_completion_length, num_micro_batches, num_items_in_batch):
    """Token sum / (sequences x max_completion_length) (Dr. GRPO: no length bias)."""
    return masked.sum() / (mask.shape[0] * max_completion_length) / num_micro_batches


def step_token_mean(masked, mask, max_completion_length, num_micro_batches, num_items_in_batch):
    """Token sum / completion tokens in the whole step batch (DAPO)."""
    return masked.sum() / torch.as_tensor(num_items_in_batch, dtype=masked.dtype).clamp(min=1.0)


for _record in (
        LossType("grpo", clipped_surrogate, sequence_mean, help="clipped surrogate, sequence mean (DeepSeekMath)"),
        LossType("bnpo", clipped_surrogate, token_mean, help="clipped surrogate, token mean of the micro-batch"),
        LossType("dr_grpo", clipped_surrogate, max_length_mean, help="clipped surrogate, sum / (B x max length)"),
        LossType("dapo", clipped_surrogate, step_token_mean, needs_num_items=True,
                 help="clipped surrogate, sum / tokens in the step"),
        LossType("cispo", cispo_surrogate, step_token_mean, needs_num_items=True,
                 help="clipped detached weight times log pi (MiniMax-M1)"),
        LossType("sapo", sapo_surrogate, sequence_mean, help="sigmoid-gated surrogate (SAPO)"),
        LossType("luspo", clipped_surrogate, sequence_sum_mean, preferred_level="sequence",
                 help="GSPO's loss summed over each sequence's tokens"),
        LossType("vespo", vespo_surrogate, step_token_mean, needs_num_items=True, preferred_level="token",
                 takes_sampling_ratio=True, help="Gamma-weighted sequence ratio times log pi (VESPO)")):
    registry.register(_record)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str | LossType, max_completion_length: int,
                   num_micro_batches: int = 1, num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
    """The micro-batch's share of the step loss by the loss type's aggregation, so that gradients summed over
    micro-batches equal TRL's for the same step (the `/ num_micro_batches` is TRL's gradient-accumulation
    normaliser; a step-level token mean divides by the step's tokens instead)."""
    kind = registry.loss_type(loss_type)
    if kind.needs_num_items and num_items_in_batch is None:
        raise ValueError(f"loss_type {kind.name!r} needs num_items_in_batch (completion tokens in the step batch)")
    per_token = per_token.expand_as(mask) if per_token.shape != mask.shape else per_token
    return kind.aggregation(per_token * mask, mask, max_completion_length, num_micro_batches, num_items_in_batch)


def clip_masks(coef_1: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float):
    """Where the clip is active: ratio below 1-eps with A<0 (low), above 1+eps with A>0 (high)."""
    adv = advantages.unsqueeze(1)
    low = (coef_1 < 1 - epsilon_low) & (adv < 0)
    high = (coef_1 > 1 + epsilon_high) & (adv > 0)
    return low, high, low | high
