"""Rotary position embedding (rotate-half form, as Llama/Qwen use): x * cos + rotate_half(x) * sin,
rounded at the same points as the PyTorch expression. Tables narrower than the head (Phi-3's and Qwen3.5's
`partial_rotary_factor`) rotate each head's first `cos.shape[-1]` dims and pass the rest through, as
transformers does."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, 1, R] (both halves equal, R <= D), in x's dtype."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([rope_reference(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    return x * cos + rotate_half(x) * sin


if HAS_TRITON:
    @triton.jit
    def _rope_kernel(X, COS, SIN, OUT, n_heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                     HALF: tl.constexpr, H_PAD: tl.constexpr, INVERSE: tl.constexpr):
        """One token, all its heads. INVERSE rotates by -angle: the transpose, which is rope's backward."""
        t = tl.program_id(0)
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < n_heads
        x_row = X + t * stride_xt + h * stride_xh
        x1 = tl.load(x_row + d, mask=mask, other=0.0)
        x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0)
        c1 = tl.load(COS + t * stride_ct + d)
        c2 = tl.load(COS + t * stride_ct + HALF + d)
        s1 = tl.load(SIN + t * stride_ct + d)
        s2 = tl.load(SIN + t * stride_ct + HALF + d)
        if INVERSE:
            s1, s2 = -s1, -s2
        dt = X.dtype.element_ty
        o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)  # the products round to x's dtype first, as in torch
        o2 = ((x2 * c2).to(dt) + (x1 * s2).to(dt)).to(dt)
        o_row = OUT + t * stride_ot + h * stride_oh
        tl.store(o_row + d, o1, mask=mask)
        tl.store(o_row + HALF + d, o2, mask=mask)


def rope_triton(x, cos, sin, inverse: bool = False):
    b, t, h, d = x.shape
    x3 = x.reshape(b * t, h, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    c, s = cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous()
    out = torch.empty((b * t, h, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(b * t,)](x3, c, s, out, h, x3.stride(0), x3.stride(1), c.stride(0), out.stride(0), out.stride(1),
                           HALF=d // 2, H_PAD=next_pow2(h), INVERSE=inverse)
    return out.view(b, t, h, d)


class RoPEFunction(torch.autograd.Function):
    """The rotation is orthogonal: its backward is the same kernel turning the other way."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_triton(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rope_triton(grad, cos, sin, inverse=True), None, None


def rope(x, cos, sin):
    """Triton on CUDA for a power-of-two head_dim (with its backward when gradients are recorded); the
    PyTorch reference otherwise. cos/sin come from positions and take no gradient."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat([rope(x[..., :d].contiguous(), cos, sin), x[..., d:]], dim=-1)
    if not (use_triton(x) and d // 2 == next_pow2(d // 2)):
        return rope_reference(x, cos, sin)
    if torch.is_grad_enabled() and x.requires_grad:
        return RoPEFunction.apply(x, cos, sin)
    return rope_triton(x, cos, sin)
