"""AdamW for bf16/fp16 parameters with fp32 master weights.

The model (and so the rollout engine, which runs the same parameters) stays in bf16: no cast of the
weights at every matmul, half the bytes per decode step. The optimizer keeps an fp32 master copy of
each parameter with its moments: a pure bf16 update would lose steps smaller than bf16's resolution
(about 0.4% of a weight), which at RL learning rates is most of them."""
from __future__ import annotations

import math

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """Steps fp32 masters of `params` and copies them back. `load_grads()` moves the parameters'
    gradients onto the masters (so that clipping acts on fp32 values); `step()` does it if needed."""

    def __init__(self, params, **kwargs):
        self.model_params = [p for p in params]
        masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        super().__init__(masters, **kwargs)
        self.masters = masters
        self._grads_loaded = False

    def load_grads(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # one copy of each gradient at a time
        self._grads_loaded = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not self._grads_loaded:
            self.load_grads()
        super().step()
        torch._foreach_copy_([p.data for p in self.model_params], self.masters)
        self._grads_loaded = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None
        self._grads_loaded = False

    def state_dict(self):
        state = super().state_dict()
        state["masters"] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            with torch.no_grad():
                for m, saved, p in zip(self.masters, masters, self.model_params):
                    m.copy_(saved)
                    p.copy_(saved)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int | None):
    """The learning-rate factor at each step: a linear warm-up, then `constant`, `linear` decay to 0 or
    `cosine` decay to 0 at `total_steps` (for LambdaLR)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
