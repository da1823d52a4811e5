"""SiLU-and-multiply of the gated MLP: silu(gate) * up, rounded at the same points as the unfused PyTorch code."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


if HAS_TRITON:
    @triton.jit
    def _silu_mul_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)
        tl.store(OUT + offs, (act.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_mul_triton(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(up)
    n = up.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
    return out


def silu_mul(gate, up):
    """Triton for inference on CUDA; the reference (with autograd) when gradients are recorded."""
    if use_triton(gate) and not torch.is_grad_enabled():
        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)
