"""One AdamW step of one tensor, reading the gradient in its own dtype (bf16 under a bf16 model: no fp32
copy of the gradients) and scaling it as it reads (gradient clipping without an in-place pass).

The formula is torch.optim.AdamW's (decoupled weight decay):
    p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
`p` is the fp32 master; `out`, when given, receives it rounded to the model's dtype. The moments are
fp32, or bf16 with stochastic rounding: round-to-nearest would lose v's updates, which at b2 = 0.999 are
0.1% of v, under bf16's resolution of 0.4% (the estimate would stop moving); rounded up or down with
the probability of the distance, each stored moment equals the fp32 one in expectation. `p` may itself be
bf16 (no master copy: the model's own weights), rounded back stochastically for the same reason: a
learning-rate-sized step is most often under half a bf16 spacing, which round-to-nearest would drop."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.optim.adamw import adamw as functional_adamw

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
    x = x.float().contiguous()
    return _round_with(x, torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator))


def _round_with(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded up or down by adding 16 random low bits (`noise`) and truncating."""
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: 0xFFFF0000


def adamw_step_reference(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None,
                         generator: torch.Generator | None = None) -> None:
    """In place, in PyTorch: the formula above on fp32 values."""
    g = grad.float() * s.grad_scale
    bc1, bc2 = s.bias_corrections
    p = master.float().mul_(1.0 - s.lr * s.weight_decay)
    m = exp_avg.float().lerp_(g, 1.0 - s.beta1)
    v = exp_avg_sq.float().mul_(s.beta2).addcmul_(g, g, value=1.0 - s.beta2)
    p.addcdiv_(m, v.sqrt().div_(bc2 ** 0.5).add_(s.eps), value=-s.lr / bc1)
    for state, new in ((exp_avg, m), (exp_avg_sq, v), (master, p)):
        if state is master and state.dtype == torch.float32:
            continue  # `.float()` of an fp32 master is the master itself: updated in place above
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
                      grad_scale, seed, HAS_OUT: tl.constexpr, BF16_STATE: tl.constexpr, BF16_MASTER: tl.constexpr,
                      BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(P + offsets, mask=mask).to(tl.float32) * decay
        g = tl.load(G + offsets, mask=mask).to(tl.float32) * grad_scale
        m = tl.load(M + offsets, mask=mask).to(tl.float32)
        v = tl.load(V + offsets, mask=mask).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
        if BF16_MASTER:
            tl.store(P + offsets, _round_bf16(p, seed + 2, offsets), mask=mask)
        else:
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
        HAS_OUT=out is not None, BF16_STATE=exp_avg.dtype == torch.bfloat16, BF16_MASTER=master.dtype == torch.bfloat16,
        BLOCK=block)


CPU_CHUNK = 1 << 18  # elements per pass of the CPU step: its fp32 copies stay in cache (fastest of 2^16..2^22)


def adamw_step_cpu(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None, chunk: int = CPU_CHUNK) -> None:
    """On the CPU (the offloaded optimizer's step, and CPU training): torch.optim.AdamW's own fused kernel,
    vectorized and on every core, over chunks of the flattened tensors. A chunk's gradient is read into fp32
    and scaled, bf16 moments into fp32 and rounded back stochastically with 32 random bits per element (the
    low 16 for m, the high 16 for v) from numpy's PCG64 seeded by `s.seed` (a third of torch's CPU generator's
    cost, which would be most of the step). The fp32 copies live in buffers of one chunk, reused."""
    flat = [t.view(-1) for t in (master, grad, exp_avg, exp_avg_sq)] + ([out.view(-1)] if out is not None else [])
    bf16_state = exp_avg.dtype == torch.bfloat16
    generator = np.random.PCG64(s.seed) if bf16_state else None
    width = min(chunk, master.numel())
    buffers = torch.empty(3 if bf16_state else 1, width)
    for start in range(0, master.numel(), chunk):
        p, g, m, v, *o = (t[start:start + chunk] for t in flat)
        g32, m32, v32 = (b[:len(p)] for b in buffers) if bf16_state else (buffers[0, :len(p)], m, v)
        g32.copy_(g)
        if s.grad_scale != 1.0:
            g32.mul_(s.grad_scale)
        if bf16_state:
            m32.copy_(m)
            v32.copy_(v)
        # the functional AdamW counts the step itself: it is given the step before this one
        functional_adamw([p], [g32], [m32], [v32], [], [torch.tensor(float(s.step - 1))], fused=True,
                         amsgrad=False, beta1=s.beta1, beta2=s.beta2, lr=s.lr, weight_decay=s.weight_decay,
                         eps=s.eps, maximize=False)
        if bf16_state:
            bits = torch.from_numpy(generator.random_raw(-(-len(p) // 2)).view(np.int32))[:len(p)]
            m.copy_(_round_with(m32, bits & 0xFFFF))
            v.copy_(_round_with(v32, (bits >> 16) & 0xFFFF))
        if o:
            o[0].copy_(p)


def adamw_step(master, grad, exp_avg, exp_avg_sq, s: AdamWStep, out=None) -> None:
    """Triton on CUDA (one pass over the tensors); on the CPU torch's fused AdamW (`adamw_step_cpu`) for
    fp32 masters; the PyTorch reference elsewhere. `master` fp32, or bf16 (the weights themselves)."""
    if master.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"AdamW updates fp32 or bf16 weights in place, not {master.dtype}: keep fp32 masters")
    if master.numel() == 0:  # an FSDP rank whose shard of a small parameter is empty
        return
    contiguous = all(t is None or t.is_contiguous() for t in (master, grad, exp_avg, exp_avg_sq, out))
    if use_triton(master) and contiguous:
        adamw_step_triton(master, grad, exp_avg, exp_avg_sq, s, out)
    elif master.device.type == "cpu" and master.dtype == torch.float32 and contiguous:
        adamw_step_cpu(master, grad, exp_avg, exp_avg_sq, s, out)
    else:
        generator = torch.Generator(master.device).manual_seed(s.seed)
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, s, out, generator)
