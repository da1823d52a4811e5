"""RMSNorm with an optional fused residual add: out = weight * norm(x + residual), also returning
x + residual (the next residual stream), rounded at the same points as the unfused PyTorch code."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: [..., H]; returns out, or (out, x + residual) when a residual is given."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


if HAS_TRITON:
    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, eps, N: tl.constexpr,
                         N_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, N_PAD)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)  # rounded to x's dtype, as torch does
            tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
        normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (normed * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm_triton(x, weight, eps, residual=None):
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                     res_out.stride(0), eps, N=n, N_PAD=next_pow2(n), HAS_RESIDUAL=residual is not None)
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


def rms_norm(x, weight, eps, residual=None):
    """Triton for inference on CUDA; the reference (with autograd) when gradients are recorded."""
    if use_triton(x) and not torch.is_grad_enabled():
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
