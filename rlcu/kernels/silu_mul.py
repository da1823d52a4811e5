"""SiLU-and-multiply of the gated MLP on the fused gate/up projection: silu(gate) * up, where gate and
up are the two halves of the last dimension, rounded at the same points as the unfused PyTorch code."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAS_TRITON:
    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_row, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_row + n_cols + cols, mask=mask, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty)
        tl.store(OUT + row * n_cols + cols, (act.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up):
    *lead, two_n = gate_up.shape
    n = two_n // 2
    gu = gate_up.reshape(-1, two_n)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, 1024))](gu, out, gu.stride(0), n, BLOCK=1024)
    return out.view(*lead, n)


def silu_mul(gate_up):
    """Triton for inference on CUDA; the reference (with autograd) when gradients are recorded."""
    if use_triton(gate_up) and not torch.is_grad_enabled():
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)
