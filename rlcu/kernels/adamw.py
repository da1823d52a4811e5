"""One AdamW step of one tensor, reading the gradient in its own dtype (bf16 under a bf16 model: no fp32
copy of the gradients) and scaling it as it reads (gradient clipping without an in-place pass).

The formula is torch.optim.AdamW's (decoupled weight decay):
    p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
`p` is the fp32 master; `out`, when given, receives it rounded to the model's dtype. The moments are
fp32, or bf16 with stochastic rounding: round-to-nearest would lose v's updates, which at b2 = 0.999 are
0.1% of v, under bf16's resolution of 0.4% (the estimate would stop moving); rounded up or down with
the probability of the distance, each stored moment equals the fp32 one in expectation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton


@dataclass(frozen=True)
class AdamWStep:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # this step's number, from 1
    grad_scale: float = 1.0  # the clipping coefficient
    seed: int = 0  # stochastic rounding of bf16 moments: a different seed at every call

    @property
    def bias_corrections(self) -> tuple[float, float]:
        return 1.0 - self.beta1 ** self.step, 1.0 - self.beta2 ** self.step


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, up or down with the probability of the distance: add 16 random low bits, truncate."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: 0xFFFF0000


def adamw_step_reference(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None,
                         generator: torch.Generator | None = None) -> None:
    """In place, in PyTorch: the formula above on fp32 values."""
    g = grad.float() * s.grad_scale
    bc1, bc2 = s.bias_corrections
    master.mul_(1.0 - s.lr * s.weight_decay)
    m = exp_avg.float().lerp_(g, 1.0 - s.beta1)
    v = exp_avg_sq.float().mul_(s.beta2).addcmul_(g, g, value=1.0 - s.beta2)
    master.addcdiv_(m, v.sqrt().div_(bc2 ** 0.5).add_(s.eps), value=-s.lr / bc1)
    for state, new in ((exp_avg, m), (exp_avg_sq, v)):
        state.copy_(new if state.dtype == torch.float32 else stochastic_round_bf16(new, generator))
    if out is not None:
        out.copy_(master)


if HAS_TRITON:
    @triton.jit
    def _round_bf16(x, seed, offsets):
        bits = x.to(tl.int32, bitcast=True) + (tl.randint(seed, offsets) & 0xFFFF).to(tl.int32)
        return (bits & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _adamw_kernel(P, G, M, V, OUT, n, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_sqrt_bc2,
                      grad_scale, seed, HAS_OUT: tl.constexpr, BF16_STATE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(P + offsets, mask=mask) * decay
        g = tl.load(G + offsets, mask=mask).to(tl.float32) * grad_scale
        m = tl.load(M + offsets, mask=mask).to(tl.float32)
        v = tl.load(V + offsets, mask=mask).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
        tl.store(P + offsets, p, mask=mask)
        if BF16_STATE:
            tl.store(M + offsets, _round_bf16(m, seed, offsets), mask=mask)
            tl.store(V + offsets, _round_bf16(v, seed + 1, offsets), mask=mask)
        else:
            tl.store(M + offsets, m, mask=mask)
            tl.store(V + offsets, v, mask=mask)
        if HAS_OUT:
            tl.store(OUT + offsets, p.to(OUT.dtype.element_ty), mask=mask)


def adamw_step_triton(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None) -> None:
    for t in (master, grad, exp_avg, exp_avg_sq, out):
        if t is not None and not t.is_contiguous():
            raise ValueError("adamw_step_triton needs contiguous tensors")
    bc1, bc2 = s.bias_corrections
    block = 1024
    # 1 - beta in double on the host, as torch does: in fp32 on the device, 1 - 0.999 is 1.3e-5 off
    _adamw_kernel[(triton.cdiv(master.numel(), block),)](
        master, grad, exp_avg, exp_avg_sq, master if out is None else out, master.numel(), 1.0 - s.beta1, s.beta2,
        1.0 - s.beta2, s.eps, 1.0 - s.lr * s.weight_decay, s.lr / bc1, 1.0 / bc2 ** 0.5, s.grad_scale, s.seed,
        HAS_OUT=out is not None, BF16_STATE=exp_avg.dtype == torch.bfloat16, BLOCK=block)


def adamw_step(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None) -> None:
    """Triton on CUDA (one pass over the tensors); the PyTorch reference elsewhere."""
    if master.numel() == 0:  # an FSDP rank whose shard of a small parameter is empty
        return
    if use_triton(master) and all(t is None or t.is_contiguous() for t in (master, grad, exp_avg, exp_avg_sq, out)):
        adamw_step_triton(master, grad, exp_avg, exp_avg_sq, s, out)
    else:
        generator = torch.Generator(master.device).manual_seed(s.seed)
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, s, out, generator)
