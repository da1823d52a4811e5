"""The update phase of a GRPO step: num_iterations x steps_per_rollout slices x [micro-batched forward/backward,
clip, optimizer step, LR schedule], with the entropy bonus's adaptive coefficient. `Update` is built from the run's
options and what it trains (the policy, a frozen reference, the loss type, the numerics, the run's counters); it
asks the Lightning module it runs in only for what `Host` lists. Input: the step's `GRPOBatch` and the rows to
train on; output: the update's metrics."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlcu.contracts import Numerics
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.batch import Counters, GRPOBatch, StagedBatch
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.grpo.metrics import LossStats
from rlcu.grpo.options import Options
from rlcu.grpo.registry import LossType
from rlcu.models.lora import lora_disabled


class Host(Protocol):
    """What the update asks of the Lightning module it runs in (GRPOModule)."""
    device: torch.device
    world_size: int
    global_step: int

    def optimizers(self) -> Any: ...

    def lr_schedulers(self) -> Any: ...

    def manual_backward(self, loss: torch.Tensor) -> None: ...

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def before_weights_change(self) -> None:
        """Before each optimizer step: whatever reads the parameters beside the update stops."""


@dataclass
class MicroBatchLoss:
    """A micro-batch's loss and what its metrics need, all detached but the loss ([b, C] per token)."""
    loss: torch.Tensor  # []
    logps: torch.Tensor
    entropy: torch.Tensor
    coef: torch.Tensor  # the importance weight pi / pi_old ([b, C], or [b, 1] at sequence level)
    kl: torch.Tensor | None
    mask: torch.Tensor
    sampling_ratio: torch.Tensor | None  # pi_old / pi_sampler after truncation or masking ([b, C] or [b, 1])


class Update:
    def __init__(self, options: Options, policy, ref_model, loss_kind: LossType, numerics: Numerics,
                 counters: Counters, host: Host, on_weights_updated: Callable[[], None],
                 fault: Callable[[str], dict[str, float]]):
        """`ref_model`: the frozen reference of the KL term (None: the policy with its LoRA adapters off);
        `on_weights_updated`: the rollout backend's hook, after each optimizer step; `fault`: records a skipped
        update (numerical faults) and returns its metrics."""
        self.options, self.policy, self.ref_model = options, policy, ref_model
        self.loss_kind, self.numerics, self.counters = loss_kind, numerics, counters
        self.host, self.on_weights_updated, self.fault = host, on_weights_updated, fault
        self._entropy_window: torch.Tensor | None = None  # the entropy bonus's [sum, tokens] in an update
        self.routers = Routers(policy, options.loss.router_aux_loss_coef)

    def __call__(self, batch: GRPOBatch, keep: torch.Tensor) -> dict[str, float]:
        """num_iterations x steps_per_rollout optimizer steps on the kept rows."""
        loss_opts, entropy = self.options.loss, self.options.entropy
        self.counters.consecutive_skips = 0
        staged = StagedBatch.of(batch, keep, self.host.device)
        slices = self._slices(staged)
        # every slice's old and reference logprobs before the first step moves the policy
        old = [self._old_logprobs(part, len(slices)) for part in slices]
        ref = [self._reference_logprobs(part) for part in slices]
        # dapo's normaliser: the rollout's completion tokens over every rank, a share of them for each slice (TRL's)
        loss_items = staged.num_items / len(slices)
        if self.host.world_size > 1:  # DDP averages gradients, so each rank divides by the global count / world size
            total = self.host.reduce_sum(staged.num_items.to(self.host.device))
            loss_items = total.cpu() / self.host.world_size / len(slices)
        stats, losses, grad_norms = LossStats(), [], []
        self.routers.start()
        gap = [torch.zeros((), device=self.host.device)] * 2  # sum, max of |trainer - sampler| logprobs, device-side
        for it in range(loss_opts.num_iterations):
            for j, part in enumerate(slices):
                loss = self._accumulate(part, old[j], ref[j], loss_items, stats, gap if it == 0 else None)
                norm = self._optimizer_step()
                if not math.isfinite(norm):  # no step was taken: the weights stay as they were
                    return self.fault(f"non-finite gradients (norm {norm}): NaN or Inf in the logits or loss")
                losses.append(float(loss))
                grad_norms.append(norm)
                if entropy.use_adaptive_entropy:
                    self._update_entropy_coef()
        out = stats.result()
        out.update(loss=sum(losses) / len(losses), grad_norm=sum(grad_norms) / len(grad_norms),
                   learning_rate=self.host.lr_schedulers().get_last_lr()[0])
        out["logprob_mismatch/mean"] = float(gap[0]) / max(float(staged.num_items), 1.0)
        out["logprob_mismatch/max"] = float(gap[1])
        self.counters.consecutive_faults = 0
        out["faults/skipped_updates"] = float(self.counters.faults)
        out.update(self.routers.metrics())
        if entropy.active:
            out["entropy_coef"] = (self.counters.entropy_coef if entropy.use_adaptive_entropy
                                   else self._entropy_coef_now())
        return out

    def _slices(self, staged: StagedBatch) -> list[StagedBatch]:
        """steps_per_rollout slices of the rows, shuffled as TRL shuffles a generation batch (by the run's seed and
        step, the same on every rank's own rows)."""
        # fewer kept rows than slices (filter_zero_std_groups on one process): a slice a row; under DDP filtered rows
        # stay masked, so every rank cuts as many slices
        parts = min(self.options.optimizer.steps_per_rollout, len(staged.rows))
        seed = self.options.sampling.seed * 1_000_003 + self.host.global_step
        return staged.split(parts, torch.Generator().manual_seed(seed))

    def _old_logprobs(self, staged: StagedBatch, slices: int = 1) -> torch.Tensor | None:
        """The old policy's logprobs of the clipped ratio: the sampler's with old_logprobs='engine'; recomputed when
        the policy moves before a row trains (num_iterations > 1, or more than one slice); else None (the
        trainer's own, detached)."""
        loss_opts = self.options.loss
        if loss_opts.old_logprobs == "engine":
            return staged.rows.sampler_logps
        if loss_opts.num_iterations == 1 and slices == 1:
            return None
        return self._logprobs_without_grad(self.policy, staged)

    def _reference_logprobs(self, staged: StagedBatch) -> torch.Tensor | None:
        if self.options.loss.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._logprobs_without_grad(self.ref_model, staged)
        with lora_disabled(self.policy):
            return self._logprobs_without_grad(self.policy, staged)

    def _logprobs_without_grad(self, model, staged: StagedBatch) -> torch.Tensor:
        mbs = staged.micro_batches(self.options.optimizer.micro_batch_size)
        return torch.cat([self._logps(model, staged, rows, grad=False)[0] for rows in mbs])

    def _accumulate(self, staged: StagedBatch, old, ref, loss_items, stats: LossStats, gap: list | None):
        """Forward and backward over the micro-batches, gradients summed; returns the loss (device)."""
        b, mbs = staged.rows, staged.micro_batches(self.options.optimizer.micro_batch_size)
        self.host.optimizers().zero_grad()
        total = torch.zeros((), device=self.host.device)
        self._entropy_window = torch.zeros(2, device=self.host.device)  # sum and tokens of the bonus's entropies
        for rows in mbs:
            out = self._micro_batch_loss(staged, rows, old, ref, loss_items, len(mbs))
            self.host.manual_backward(out.loss)
            total += out.loss.detach()
            if gap is not None:  # sampler vs trainer logprobs of the same tokens under the same weights
                diff = (out.logps - b.sampler_logps[rows]).abs() * out.mask
                gap[0], gap[1] = gap[0] + diff.sum(), torch.maximum(gap[1], diff.max())
            adv = b.advantages[rows]
            stats.add(out.mask, out.entropy, out.kl, *grpo_loss.clip_masks(out.coef, adv, self.options.loss.epsilon,
                                                                           self.options.loss.epsilon_upper))
            if out.sampling_ratio is not None and gap is not None:
                stats.add_sampling_ratio(out.sampling_ratio, out.mask)
        return total

    def _micro_batch_loss(self, staged: StagedBatch, rows: slice, old, ref, loss_items,
                          num_micro_batches: int) -> MicroBatchLoss:
        """One micro-batch's loss as TRL's `_compute_loss` forms it: policy term (top-entropy tokens only when
        top_entropy_quantile < 1; corrected for the sampler and masked off-policy as configured), KL, the
        aggregation, the entropy bonus."""
        lo, en, b, sc = self.options.loss, self.options.entropy, staged.rows, self.options.correction
        with self.routers.recording():
            logps, entropy = self._logps(self.policy, staged, rows, grad=True)
        mask, adv, sampler = b.loss_mask[rows].float(), b.advantages[rows], b.sampler_logps[rows]
        # a sampler logprob of NaN (not known) counts as the trainer's own
        old_lp = logps.detach() if old is None else torch.where(old[rows].isnan(), logps.detach(), old[rows])
        top = ratio = keep = None
        if en.top_entropy_quantile < 1.0:
            top = grpo_loss.high_entropy_mask(entropy.detach(), mask, en.top_entropy_quantile).to(mask.dtype)
        if sc.enabled:  # pi_old / pi_sampler: TRL's TIS / MIS weight
            ratio = grpo_loss.sampling_ratio(old_lp, sampler, mask, sc.mode, sc.vllm_importance_sampling_clip_min,
                                             sc.vllm_importance_sampling_clip_max)
        if sc.off_policy_mask_threshold is not None:
            keep = grpo_loss.off_policy_mask(adv, logps, sampler, mask, sc.off_policy_mask_threshold)
        ptl, coef, kl = grpo_loss.per_token_loss(logps, old_lp, adv, mask, lo.epsilon, lo.epsilon_upper,
                                                 lo.importance_sampling_level, ref[rows] if ref is not None else None,
                                                 lo.beta, self.loss_kind, lo, top, ratio, keep)
        max_length = self.options.sampling.max_completion_length
        loss = grpo_loss.aggregate_loss(ptl, mask, self.loss_kind, max_length, num_micro_batches,
                                        loss_items)
        if en.active:
            effective = mask if top is None else mask * top
            loss = loss - self._entropy_coef_now() * grpo_loss.entropy_bonus(entropy, effective, num_micro_batches)
            self._entropy_window += torch.stack([(entropy.detach() * effective).sum(), effective.sum()])
        if self.routers.moe:  # the router logits of every token the forward saw, padding left out
            packed = self.options.optimizer.packing or self.numerics.batch_invariant  # exact runs packed too
            token_mask = b.attention_mask[rows].reshape(-1).bool() if not packed and staged.padded(rows) else None
            loss = loss + self.routers.loss(token_mask, num_micro_batches, sampler_routing(b, rows, packed))
        return MicroBatchLoss(loss, logps.detach(), entropy.detach(), coef.detach(),
                              kl.detach() if kl is not None else None, mask, ratio)

    def _entropy_coef_now(self) -> float:
        """The entropy bonus's coefficient: entropy_coef, or with use_adaptive_entropy the controller's, applied
        only while the last step's entropy was at or below entropy_target (TRL's rule)."""
        hp, c = self.options.entropy, self.counters
        if not hp.use_adaptive_entropy:
            return hp.entropy_coef
        coef = hp.entropy_coef if c.entropy_coef is None else c.entropy_coef
        return coef if c.last_entropy <= hp.entropy_target else 0.0

    def _update_entropy_coef(self) -> None:
        """After an optimizer step: the adaptive controller moves the coefficient by the step's mean entropy."""
        hp, c = self.options.entropy, self.counters
        window = self._entropy_window
        if self.host.world_size > 1:
            window = self.host.reduce_sum(window)
        c.last_entropy = float(window[0] / window[1].clamp(min=1.0))
        start = hp.entropy_coef if c.entropy_coef is None else c.entropy_coef
        c.entropy_coef = grpo_loss.adaptive_entropy_coef(start, c.last_entropy, hp.entropy_target,
                                                         hp.entropy_coef_delta, hp.entropy_coef_min,
                                                         hp.entropy_coef_max)

    def _optimizer_step(self) -> float:
        """Clip, step, schedule; returns the gradient norm, and takes no step when it is not finite."""
        opt, sched = self.host.optimizers(), self.host.lr_schedulers()
        norm = opt.optimizer.grad_norm()
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor holding each rank's partial norm
            norm = norm.full_tensor()
        value = float(norm)
        if not math.isfinite(value):  # under DDP every rank sees the same averaged gradients: all skip together
            opt.zero_grad()
            return value
        # torch's clipping coefficient, applied as the step reads the gradients
        max_norm = self.options.optimizer.max_grad_norm
        self.host.before_weights_change()
        opt.step(grad_scale=min(1.0, max_norm / (value + 1e-6)) if max_norm else 1.0)
        opt.zero_grad()  # the gradients would otherwise sit through the next rollout
        sched.step()
        self.on_weights_updated()
        return value

    def _logps(self, model, staged: StagedBatch, rows: slice, grad: bool):
        # only the policy's logprobs meet the sampler's: a frozen reference keeps the fast kernels
        numerics = self.numerics if model is self.policy else Numerics.FAST
        packing = self.options.optimizer.packing
        padded = packing or staged.padded(rows)
        b = staged.rows
        ids, mask = b.input_ids[rows], b.attention_mask[rows] if padded else None
        with torch.set_grad_enabled(grad):
            return completion_logprobs(model, ids, mask, b.loss_mask.shape[1], self.options.sampling.temperature,
                                       packed=packing, numerics=numerics)


def sampler_routing(b: GRPOBatch, rows: slice, packed: bool) -> torch.Tensor | None:
    """The sampler's routing of a micro-batch laid out as its forward's tokens: a completion token's record sits at
    the position that predicts it, the rows' tokens are packed (padding left out) or padded as the forward ran."""
    if b.sampler_routing is None:
        return None
    r = b.sampler_routing[rows]
    n, length = b.input_ids[rows].shape
    c = r.shape[1]
    grid = r.new_full((n, length, *r.shape[2:]), -1)
    grid[:, length - c - 1:length - 1] = r
    return grid[b.attention_mask[rows].bool()] if packed else grid.flatten(0, 1)


def routed_elsewhere(experts: list[torch.Tensor], sampler: torch.Tensor) -> torch.Tensor:
    """[tokens whose top-k differs from the sampler's in some MoE layer, tokens compared], device-side: `experts`
    are the training forward's picks per layer ([T, k] each), `sampler` the record in the same layout."""
    picked = torch.stack(experts, 1)
    known = sampler[:, 0, 0] >= 0
    differs = (picked.sort(-1).values != sampler.long().sort(-1).values).flatten(1).any(1) & known
    return torch.stack([differs.sum(), known.sum()])


class Routers:
    """A mixture-of-experts policy's routers during the update: their load-balancing loss (TRL's
    `router_aux_loss_coef`, None: the model config's own coefficient) and how evenly they route."""

    def __init__(self, policy, coef: float | None):
        from rlcu.models.moe import SparseMoE

        self.moe = [m for m in policy.modules() if isinstance(m, SparseMoE)]
        if coef and not self.moe:
            raise ValueError(f"router_aux_loss_coef={coef}: {policy.config.model_type} is not a mixture-of-experts "
                             "model rlcu runs natively, so there is no router to balance; leave router_aux_loss_coef "
                             "unset")
        self.coef = (policy.config.router_aux_loss_coef if self.moe else 0.0) if coef is None else coef
        self.top_k = self.moe[0].top_k if self.moe else 0
        self.start()

    def start(self) -> None:
        self.aux: list[torch.Tensor] = []
        self.load_max: list[torch.Tensor] = []
        self.mismatch: list[torch.Tensor] = []  # per micro-batch: [tokens routed elsewhere, tokens compared]

    @contextlib.contextmanager
    def recording(self):
        for m in self.moe:
            m.keep_router_logits = True
        try:
            yield
        finally:
            for m in self.moe:
                m.keep_router_logits = False

    def loss(self, token_mask: torch.Tensor | None, num_micro_batches: int,
             sampler: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's load-balancing loss, scaled as the policy loss is for accumulation (TRL's), or 0.
        `sampler`: [tokens of the forward, MoE layers, k] the sampler's routing (-1: none to compare)."""
        from rlcu.models.moe import expert_load_max, load_balancing_loss

        logits = [m.router_logits for m in self.moe]
        if sampler is not None:
            self.mismatch.append(routed_elsewhere([m.router_experts for m in self.moe], sampler))
        for m in self.moe:
            m.router_logits = m.router_experts = None
        self.load_max.append(expert_load_max(logits, self.top_k, token_mask))
        if not self.coef:
            return torch.zeros((), device=logits[0].device)
        aux = load_balancing_loss(logits, self.top_k, token_mask)
        self.aux.append(aux.detach())
        return self.coef * aux / num_micro_batches

    def metrics(self) -> dict[str, float]:
        if not self.moe:
            return {}
        out = {"moe/expert_load_max": float(torch.stack(self.load_max).max())} if self.load_max else {}
        if self.mismatch:  # the share of compared tokens the trainer routes elsewhere than the sampler did
            differs, compared = torch.stack(self.mismatch).sum(0).tolist()
            out["moe/routing_mismatch"] = differs / max(compared, 1)
        if self.aux:
            out["aux_loss"] = float(torch.stack(self.aux).mean())
        return out
