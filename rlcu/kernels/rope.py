"""Rotary position embedding (rotate-half form, as Llama/Qwen use): x * cos + rotate_half(x) * sin,
rounded at the same points as the PyTorch expression."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, 1, D] (both halves equal), in x's dtype."""
    return x * cos + rotate_half(x) * sin


if HAS_TRITON:
    @triton.jit
    def _rope_kernel(X, COS, SIN, OUT, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh, HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        x_row = X + t * stride_xt + h * stride_xh
        x1 = tl.load(x_row + d)
        x2 = tl.load(x_row + HALF + d)
        c1 = tl.load(COS + t * stride_ct + d)
        c2 = tl.load(COS + t * stride_ct + HALF + d)
        s1 = tl.load(SIN + t * stride_ct + d)
        s2 = tl.load(SIN + t * stride_ct + HALF + d)
        dt = X.dtype.element_ty
        o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)  # the products round to x's dtype first, as in torch
        o2 = ((x2 * c2).to(dt) + (x1 * s2).to(dt)).to(dt)
        o_row = OUT + t * stride_ot + h * stride_oh
        tl.store(o_row + d, o1)
        tl.store(o_row + HALF + d, o2)


def rope_triton(x, cos, sin):
    b, t, h, d = x.shape
    x3 = x.reshape(b * t, h, d)
    c, s = cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous()
    out = torch.empty_like(x3)
    assert x3.stride(-1) == 1
    _rope_kernel[(b * t, h)](x3, c, s, out, x3.stride(0), x3.stride(1), c.stride(0), out.stride(0), out.stride(1),
                             HALF=d // 2)
    return out.view(b, t, h, d)


def rope(x, cos, sin):
    """Triton for inference on CUDA (power-of-two head_dim); the reference (with autograd) otherwise."""
    d = x.shape[-1]
    if use_triton(x) and not torch.is_grad_enabled() and d // 2 == next_pow2(d // 2):
        return rope_triton(x, cos, sin)
    return rope_reference(x, cos, sin)
