"""AdamW for bf16/fp16 parameters with fp32 master weights, and moments in fp32 or bf16.

The model (and so the rollout engine, which runs the same parameters) stays in bf16: no cast of the
weights at every matmul, half the bytes per decode step. The optimizer keeps an fp32 master copy of
each parameter with its moments: a pure bf16 update would lose steps smaller than bf16's resolution
(about 0.4% of a weight), which at RL learning rates is most of them. Gradients stay in the model's
dtype: the step (kernels/adamw.py) reads them as they are and applies the clipping coefficient as it
reads, so a bf16 model costs 2 + 2 + 4 + 8 bytes a parameter (weights, gradients, masters, moments),
or 2 + 2 + 4 + 4 with `state_dtype=torch.bfloat16`. With `master_weights=False` the bf16 weights are their
own masters, updated with stochastic rounding (kernels/adamw.py): 2 + 2 + 4 with bf16 moments, the bytes of a
pure-bf16 trainer (TRL's under `bf16=True` with a bf16 model), whose round-to-nearest update loses the steps
that stochastic rounding keeps in expectation. With `offload=True` the masters and moments live in
host memory and the step runs there, one tensor at a time (its gradient copied down, the updated weights
copied back up) through torch's fused CPU AdamW (kernels/adamw.py `adamw_step_cpu`): the GPU keeps only the
weights and gradients, 4 bytes a parameter, for the time of two transfers and a CPU AdamW pass over the model
at every step."""
from __future__ import annotations

import torch

from rlcu.kernels.adamw import AdamWStep, adamw_step
from rlcu.models.tensor_parallel import grad_norm as tensor_parallel_grad_norm

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked host memory where there is a GPU to copy to and from (copies at full PCIe speed)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of an FSDP parameter (a DTensor); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


OFFLOAD_WITHOUT_MASTERS = ("master_weights=False updates the weights where they are; optimizer_offload moves fp32 "
                           "masters to host memory: use one of the two")


def _check_own_masters(params: list[torch.Tensor], offload: bool) -> None:
    if offload:
        raise ValueError(OFFLOAD_WITHOUT_MASTERS)
    dtypes = {p.dtype for p in params} - {torch.float32, torch.bfloat16}
    if dtypes:
        raise ValueError(f"master_weights=False updates bf16 (or fp32) weights in place, not {sorted(map(str, dtypes))}"
                         ": load the model in bfloat16, or keep master_weights=True")


class MasterWeightAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update over fp32 masters of `params` (a parameter that is fp32 already is its own
    master, and with `master_weights=False` a bf16 one too), writing the rounded result back into the parameters.
    `step(grad_scale=c)` scales the gradients by `c` (the clipping coefficient) as it reads them.
    `tensor_parallel`: (which params are shares, their group) when the model is split across ranks
    (`rlcu/models/tensor_parallel.py`), for the gradient norm."""

    tensor_parallel: tuple | None = None

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 state_dtype: torch.dtype = torch.float32, fused: bool | None = None, offload: bool = False,
                 master_weights: bool = True):
        del fused  # one fused kernel on CUDA always; the argument is torch.optim.AdamW's
        self.model_params = list(params)
        if offload and any(hasattr(p, "to_local") for p in self.model_params):
            raise ValueError("optimizer_offload keeps one process's whole optimizer state in host memory; under fsdp2 "
                             "the state is sharded across GPUs already: use one of the two")
        if not master_weights:
            _check_own_masters(self.model_params, offload)
        own = (torch.float32,) if master_weights else (torch.float32, torch.bfloat16)
        if offload:
            masters = [_pinned(p.detach().to("cpu", torch.float32, copy=True)) for p in self.model_params]
        else:
            masters = [p if p.dtype in own else p.detach().float().clone() for p in self.model_params]
        super().__init__(masters, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.masters, self.state_dtype, self.offload = masters, state_dtype, offload
        self._staging: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # offload: pinned transfer buffers

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model_params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of all gradients, accumulated in fp32 whatever their dtype."""
        grads = self.gradients()
        if not grads:
            return torch.tensor(0.0)
        if self.tensor_parallel is not None:  # shares of some tensors: their squares are summed over the group
            return tensor_parallel_grad_norm(self.model_params, *self.tensor_parallel)
        if all(g.dtype == torch.float32 for g in grads):  # FSDP's DTensors among them: torch sums the shards
            return torch.nn.utils.get_total_norm(grads)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = closure() if closure is not None else None
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for master in group["params"]:
                param, index = self.model_params[index], index + 1
                if param.grad is None:
                    continue
                state = self._state(master)
                state["step"] += 1
                s = AdamWStep(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], state["step"],
                              grad_scale, seed=(state["step"] * 7919 + index * 104729) % (2**31 - 1))
                if self.offload:
                    self._host_step(param, master, state, s)
                else:
                    adamw_step(_local(master), _local(param.grad), _local(state["exp_avg"]),
                               _local(state["exp_avg_sq"]), s, out=None if param is master else _local(param))
        return loss

    def _host_step(self, param: torch.Tensor, master: torch.Tensor, state: dict, s: AdamWStep) -> None:
        """Offloaded: the gradient down to host memory, the step there, the weights back in their dtype."""
        n = param.numel()
        grad = self._buffer(param.grad.dtype, n)
        grad.copy_(param.grad.reshape(-1))  # into pinned memory: waits for the gradient, as the step must
        weights = self._buffer(param.dtype, n, slot=1)  # the step writes the rounded weights as it goes
        adamw_step(master.view(-1), grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), s, out=weights)
        param.detach().view(-1).copy_(weights)  # synchronous: the buffer is reused by the next tensor

    def _buffer(self, dtype: torch.dtype, n: int, slot: int = 0) -> torch.Tensor:
        key = (dtype, slot)
        if key not in self._staging or self._staging[key].numel() < n:
            self._staging[key] = _pinned(torch.empty(n, dtype=dtype))
        return self._staging[key][:n]

    def _state(self, master: torch.Tensor) -> dict:
        state = self.state[master]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(master, dtype=self.state_dtype)
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    def state_dict(self):
        state = super().state_dict()
        copies = [m.detach().clone() for m, p in zip(self.masters, self.model_params) if m is not p]
        if copies:  # FSDP's checkpointing maps the state to parameters by identity: no extra key then
            state["masters"] = copies
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        super().load_state_dict(state_dict)  # (which casts the moments to the masters' dtype)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)
            if "step" in state:
                state["step"] = int(state["step"])
        if masters is not None:
            copied = [(m, p) for m, p in zip(self.masters, self.model_params) if m is not p]
            with torch.no_grad():
                for (m, p), saved in zip(copied, masters):
                    m.copy_(saved)
                    p.copy_(saved)

