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

    @triton.jit
    def _silu_mul_backward_kernel(GU, DOUT, DGU, stride_row, n_cols, BLOCK: tl.constexpr):
        """d up = dout * silu(gate); d gate = dout * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        act = (g * sig).to(GU.dtype.element_ty).to(tl.float32)
        dt = DGU.dtype.element_ty
        tl.store(DGU + row * 2 * n_cols + cols, (dout * u * sig * (1.0 + g * (1.0 - sig))).to(dt), mask=mask)
        tl.store(DGU + row * 2 * n_cols + n_cols + cols, (dout * act).to(dt), mask=mask)


def silu_mul_triton(gate_up):
    *lead, two_n = gate_up.shape
    n = two_n // 2
    gu = _rows(gate_up)
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, 1024))](gu, out, gu.stride(0), n, BLOCK=1024)
    return out.view(*lead, n)


def _rows(gate_up):
    gu = gate_up.reshape(-1, gate_up.shape[-1])
    return gu if gu.stride(-1) == 1 else gu.contiguous()


def silu_mul_backward_triton(gate_up, dout):
    gu, n = _rows(gate_up), gate_up.shape[-1] // 2
    d = dout.reshape(-1, n).contiguous()
    dgu = torch.empty((gu.shape[0], 2 * n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_backward_kernel[(gu.shape[0], triton.cdiv(n, 1024))](gu, d, dgu, gu.stride(0), n, BLOCK=1024)
    return dgu.view(gate_up.shape)


class SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return silu_mul_triton(gate_up)

    @staticmethod
    def backward(ctx, dout):
        return silu_mul_backward_triton(ctx.saved_tensors[0], dout)


def silu_mul(gate_up):
    """Triton on CUDA (with its backward when gradients are recorded); the PyTorch reference elsewhere."""
    if not use_triton(gate_up):
        return silu_mul_reference(gate_up)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return SiluMulFunction.apply(gate_up)
    return silu_mul_triton(gate_up)
