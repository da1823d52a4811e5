"""The typed data a GRPO step passes between its phases (torchtune's GRPOTrajectory is the model):
the rollout as training tensors (`GRPOBatch`), the rows staged on the device for the update
(`StagedBatch`), and what the step keeps for callbacks (`ScoredRollout`).

N = prompts x G completions (each prompt's G adjacent), P = prompt slots (left-padded),
C = completion slots (right-padded), R = rewards."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from rlcu.agents import Episodes
from rlcu.contracts import RolloutBatch


@dataclass
class Sampled:
    """A rollout, and with tools or environments the episodes behind it (messages, environments, counts)."""
    batch: RolloutBatch
    episodes: Episodes | None = None


@dataclass
class GRPOBatch:
    input_ids: torch.Tensor  # [N, P + C] long: prompt then completion, as TRL lays them out
    attention_mask: torch.Tensor  # [N, P + C] long: 1 on real tokens
    loss_mask: torch.Tensor  # [N, C] long: sampled completion tokens that carry loss (not tool / environment ones)
    advantages: torch.Tensor  # [N] float
    sampler_logps: torch.Tensor  # [N, C] float: the sampler's logprob of each token (0 on padding)
    truncated: torch.Tensor  # [N] bool: stopped by max_completion_length
    lengths: torch.Tensor  # [N] long: completion tokens the model sampled (TRL's count in episodes)
    # [N, C, MoE layers, k] int16: the experts the sampler's forward picked for each completion token (-1 on
    # padding); None for a dense model, or a backend that does not record them
    sampler_routing: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch, advantages: torch.Tensor, pad_id: int,
                     mask_truncated: bool = False) -> "GRPOBatch":
        n, p = len(rollout), max(len(x) for x in rollout.prompt_ids)
        c = max(1, max(len(x) for x in rollout.completion_ids))
        prompt = torch.full((n, p), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros(n, p, dtype=torch.long)
        completion = torch.full((n, c), pad_id, dtype=torch.long)
        completion_mask = torch.zeros(n, c, dtype=torch.long)
        sampler_logps = torch.zeros(n, c)
        for i, (pi, ci, lp) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs)):
            prompt[i, p - len(pi):], prompt_mask[i, p - len(pi):] = torch.tensor(pi), 1
            if ci:
                completion[i, :len(ci)], completion_mask[i, :len(ci)] = torch.tensor(ci), 1
                sampler_logps[i, :len(ci)] = torch.tensor(lp)
        truncated = torch.tensor([r == "length" for r in rollout.finish_reasons])
        loss_mask = completion_mask.clone()
        if rollout.tool_mask is not None:  # tokens a tool or an environment added carry no loss
            for i, mask in enumerate(rollout.tool_mask):
                loss_mask[i, :len(mask)] *= torch.tensor(mask, dtype=torch.long)
        sampled = loss_mask.sum(1)
        if mask_truncated:
            loss_mask[truncated] = 0
        return cls(torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1), loss_mask,
                   advantages, sampler_logps, truncated, sampled, _routing(rollout.routing, c))

    def __len__(self) -> int:
        return len(self.input_ids)

    def rows(self, index: torch.Tensor) -> "GRPOBatch":
        return GRPOBatch(**{f.name: _map(getattr(self, f.name), lambda t: t[index]) for f in fields(self)})

    def to(self, device: torch.device) -> "GRPOBatch":
        """On CUDA from pinned memory and without waiting: a copy from pageable memory can hold the host
        until the GPU has drained its queue."""
        if device.type != "cuda":
            return self
        return GRPOBatch(**{f.name: _map(getattr(self, f.name), lambda t: t.pin_memory().to(device, non_blocking=True))
                            for f in fields(self)})


def _map(value: torch.Tensor | None, fn):
    return None if value is None else fn(value)


def _routing(routing: list[torch.Tensor] | None, c: int) -> torch.Tensor | None:
    """The rollout's routing records as one [N, C, MoE layers, k] tensor, -1 past each completion."""
    if routing is None:
        return None
    layers, k = next((r.shape[1:] for r in routing if len(r)), (0, 0))
    if not layers:  # no completion token at all
        return None
    out = torch.full((len(routing), c, layers, k), -1, dtype=torch.int16)
    for i, r in enumerate(routing):
        out[i, :len(r)] = r
    return out


@dataclass
class StagedBatch:
    """The rows an update trains on, copied to the device once, so the micro-batch loop only slices device
    tensors and queues no copy of its own."""
    rows: GRPOBatch  # n kept rows, on the training device
    host_attention_mask: torch.Tensor  # [n, P + C] on the host: padding is detected without a device sync
    num_items: torch.Tensor  # [] float, host: completion tokens with loss in these rows

    @classmethod
    def of(cls, batch: GRPOBatch, keep: torch.Tensor, device: torch.device) -> "StagedBatch":
        kept = batch.rows(keep.nonzero()[:, 0])
        return cls(kept.to(device), kept.attention_mask, kept.loss_mask.sum().float())

    def split(self, parts: int, generator: torch.Generator) -> list["StagedBatch"]:
        """The rows shuffled, then cut into `parts` slices (TRL's steps_per_generation; sizes differ by one at
        most)."""
        if parts == 1:
            return [self]
        order = torch.randperm(len(self.rows), generator=generator)
        out = []
        for idx in order.tensor_split(parts):
            part = self.rows.rows(idx.to(self.rows.input_ids.device))
            out.append(StagedBatch(part, self.host_attention_mask[idx], part.loss_mask.sum().float().cpu()))
        return out

    def micro_batches(self, size: int) -> list[slice]:
        n = len(self.rows)
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]

    def padded(self, rows: slice) -> bool:
        return not bool(self.host_attention_mask[rows].all())


@dataclass
class ScoredRollout:
    """A step's completions with their scores, kept for callbacks (the completions table)."""
    prompts: list  # [N] each row's prompt (text or chat messages)
    completions: list  # [N] text, or [{"role": "assistant", "content": ...}] for chat prompts
    rewards: torch.Tensor  # [N, R] each reward's value (NaN: not applicable)
    advantages: torch.Tensor | None = None  # [N], once computed
    extra: dict[str, list] | None = None  # columns rewards added with TRL's `log_extra(column, values)`


@dataclass
class Counters:
    """What the run counts across steps; saved in checkpoints so a resumed run goes on counting."""
    consecutive_skips: int = 0  # batches in a row that filter_zero_std_groups left empty
    faults: int = 0  # updates skipped for numerical faults, in all
    consecutive_faults: int = 0
    entropy_coef: float | None = None  # use_adaptive_entropy: the coefficient now (None: entropy_coef's start)
    last_entropy: float = math.inf  # use_adaptive_entropy: the mean entropy of the last optimizer step
