"""The one place each GRPO metric is defined. Names follow TRL's GRPOTrainer so dashboards carry over:
reward, reward_std, rewards/<name>/mean|std, frac_reward_zero_std, completions/*, clip_ratio/*,
entropy, kl, sampling/importance_sampling_ratio/min|mean|max (the sampler correction), plus rlcu's
timing/* (generate, score, train; elapsed: seconds since training started),
tokens_per_second, memory/generate_GB and memory/train_GB (CUDA peaks of
each phase, set in the module), scored_during_generation (with that option: the share of completions
scored when the rollout ended), faults/skipped_updates and eval/*."""
from __future__ import annotations

import torch

from rlcu.grpo.loss import nanstd


def _item(x: torch.Tensor) -> float:
    return float(x.item()) if x.numel() else float("nan")


def reward_metrics(rewards_per_func: torch.Tensor, names: list[str], rewards: torch.Tensor,
                   is_std_zero: torch.Tensor) -> dict[str, float]:
    out = {}
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = _item(torch.nanmean(rewards_per_func[:, j]))
        out[f"rewards/{name}/std"] = _item(nanstd(rewards_per_func[:, j]))
    out["reward"] = _item(torch.nanmean(rewards))
    out["reward_std"] = _item(nanstd(rewards))
    out["frac_reward_zero_std"] = _item(is_std_zero.float().mean())
    return out


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    lengths = lengths.float()
    done = lengths[~truncated]
    out = {"completions/mean_length": _item(lengths.mean()), "completions/min_length": _item(lengths.min()),
           "completions/max_length": _item(lengths.max()), "completions/clipped_ratio": _item(truncated.float().mean())}
    out["completions/mean_terminated_length"] = _item(done.mean()) if done.numel() else 0.0
    return out


class LossStats:
    """Token-weighted means over all micro-batches of an update, as TRL reduces them. The sums stay on
    the device until `result()`, so that micro-batches queue on the GPU without waiting for the host."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.low_min: torch.Tensor | None = None
        self.high_max: torch.Tensor | None = None
        self.ratio: list[torch.Tensor] | None = None  # sampler correction: [min, sum, max, count] on the device

    def _add(self, key: str, x: torch.Tensor, mask: torch.Tensor):
        if x.shape[1] == 1:  # sequence-level (GSPO): one value per sequence
            s, c = x.sum(), x.new_tensor(float(x.shape[0]))
        else:
            s, c = (x * mask).sum(), mask.sum()
        self.sums[key] = self.sums[key] + s if key in self.sums else s
        self.counts[key] = self.counts[key] + c if key in self.counts else c

    def add(self, mask, entropy, kl, low, high, region):
        with torch.no_grad():
            mask = mask.float()
            self._add("entropy", entropy, mask)
            if kl is not None:
                self._add("kl", kl, mask)
            for key, x in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                           ("clip_ratio/region_mean", region)):
                self._add(key, x.float(), mask)
            seq = lambda x: x.float().squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            low_min, high_max = seq(low).min(), seq(high).max()
            self.low_min = low_min if self.low_min is None else torch.minimum(self.low_min, low_min)
            self.high_max = high_max if self.high_max is None else torch.maximum(self.high_max, high_max)

    def add_sampling_ratio(self, ratio: torch.Tensor, mask: torch.Tensor):
        """TRL's sampling/importance_sampling_ratio/*: over completion tokens, or over sequences at sequence level."""
        with torch.no_grad():
            if ratio.shape[1] == 1:
                values = ratio.float().squeeze(1)
                keep = torch.ones_like(values, dtype=torch.bool)
            else:
                values, keep = ratio.float(), mask.bool()
            inf = torch.tensor(float("inf"), device=ratio.device)
            part = [torch.where(keep, values, inf).min(), (values * keep).sum(), torch.where(keep, values, -inf).max(),
                    keep.sum().float()]
            if self.ratio is None:
                self.ratio = part
            else:
                r = self.ratio
                self.ratio = [torch.minimum(r[0], part[0]), r[1] + part[1], torch.maximum(r[2], part[2]),
                              r[3] + part[3]]

    def result(self) -> dict[str, float]:
        out = {k: float(self.sums[k]) / max(float(self.counts[k]), 1.0) for k in self.sums}
        if self.sums:
            out["clip_ratio/low_min"], out["clip_ratio/high_max"] = float(self.low_min), float(self.high_max)
        if self.ratio is not None and float(self.ratio[3]) > 0:
            low, total, high, count = (float(x) for x in self.ratio)
            out.update({"sampling/importance_sampling_ratio/min": low,
                        "sampling/importance_sampling_ratio/mean": total / count,
                        "sampling/importance_sampling_ratio/max": high})
        return out


def eval_metrics(greedy_correct: torch.Tensor, greedy_reward: torch.Tensor, greedy_lengths: torch.Tensor,
                 sampled_correct: torch.Tensor | None) -> dict[str, float]:
    """Held-out evaluation, per prompt then averaged: accuracy of the greedy completion, its reward
    and length; with k samples per prompt ([prompts, k]), pass@k (any sample correct) and mean@k."""
    out = {"eval/accuracy": _item(greedy_correct.float().mean()), "eval/reward": _item(torch.nanmean(greedy_reward)),
           "eval/mean_length": _item(greedy_lengths.float().mean())}
    if sampled_correct is not None and sampled_correct.numel():
        k = sampled_correct.shape[1]
        out[f"eval/pass@{k}"] = _item(sampled_correct.any(1).float().mean())
        out[f"eval/mean@{k}"] = _item(sampled_correct.float().mean())
    return out
