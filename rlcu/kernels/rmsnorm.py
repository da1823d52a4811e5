"""RMSNorm with an optional fused residual add: out = weight * norm(x + residual), also returning
x + residual (the next residual stream), rounded at the same points as the unfused PyTorch code.

Forward and backward are Triton kernels, so training runs them too (the unfused PyTorch form is eight
elementwise passes over fp32 copies each way). Rows are addressed as [M, H, N] with any strides for M
and H, so per-head norms (Qwen3's q/k norm) read straight from the fused q/k/v projection without a copy.

`offset` 1.0 is Gemma's form: the checkpoint stores w, the row scales by 1 + w, and the product is taken in fp32
before one rounding to the input's dtype (where Llama's form rounds the normed row first, then multiplies).

`x_scale` (with a residual) is Granite's residual multiplier: norm(x * x_scale + residual), the product rounded to
x's dtype first as the unfused `residual + x * multiplier` rounds it, in the same launch.

`add_to` is OLMo 2/3's post-norm residual: add_to + norm(x), the norm rounded to its own dtype first as the unfused
`x + norm(branch)` rounds it, then the sum rounded once, in the norm's launch.

`gate` is Gated DeltaNet's output norm (Qwen3.5, Qwen3-Next): (w * norm(x)) * silu(gate) in fp32, rounded once to
x's dtype, in the one launch where PyTorch takes eleven elementwise passes a layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, next_pow2, num_sms, tl, triton, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       offset: float = 0.0, gate: torch.Tensor | None = None, x_scale: float = 1.0,
                       add_to: torch.Tensor | None = None):
    """x, residual, gate, add_to: [..., H]; returns out (add_to + out with add_to), or (out, x * x_scale + residual)
    when a residual is given."""
    if residual is not None:
        x = (x if x_scale == 1.0 else x * x_scale) + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (offset + weight.float())).to(x.dtype) if offset else weight * h.to(x.dtype)
    if gate is not None:  # transformers' Qwen3_5RMSNormGated: the gate in fp32, one rounding
        out = (out * F.silu(gate.float())).to(x.dtype)
    if add_to is not None:
        out = add_to + out
    return out if residual is None else (out, x)


if HAS_TRITON:
    @triton.jit
    def _row_offsets(rows, H, stride_m, stride_h):
        return (rows // H) * stride_m + (rows % H) * stride_h

    @triton.jit
    def _rms_norm_kernel(X, R, W, G, OUT, RES_OUT, RSTD, n_rows, H, sx_m, sx_h, sr_m, sr_h, sg_m, sg_h, eps, x_scale,
                         N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         OFFSET: tl.constexpr, HAS_GATE: tl.constexpr, PRODUCT_FP32: tl.constexpr,
                         X_SCALED: tl.constexpr, HAS_ADD: tl.constexpr, ROUND_NORM: tl.constexpr):
        """HAS_GATE: OUT = (w * normed) * silu(G) in fp32, w * normed first rounded as torch would (to x's dtype
        unless PRODUCT_FP32, where the weight is fp32 and x narrower). HAS_ADD: OUT = G + the norm (the G pointer
        carries the addend), the norm first rounded to x's dtype where ROUND_NORM (else its dtype is fp32)."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, N_PAD)
        mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
        dense = rows[:, None] * N + cols[None, :]  # OUT, RES_OUT: contiguous [rows, N]
        x = tl.load(X + _row_offsets(rows, H, sx_m, sx_h)[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            if X_SCALED:  # x * x_scale in fp32, rounded to x's dtype, as torch multiplies by a Python float
                x = (x.to(tl.float32) * x_scale).to(X.dtype.element_ty)
            x = x + tl.load(R + _row_offsets(rows, H, sr_m, sr_h)[:, None] + cols[None, :], mask=mask, other=0.0)
            x = x.to(RES_OUT.dtype.element_ty)  # rounded to the sum's dtype, as torch does
            tl.store(RES_OUT + dense, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)
        # stored whether or not backward needs it: one compiled kernel for training and inference, so that the
        # two round alike (exact_logprobs; a second variant may compile to other bits)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if OFFSET != 0.0:  # Gemma: (normed * (1 + w)) in fp32, one rounding
            y = h * rstd[:, None] * (OFFSET + w[None, :])
        else:
            if HAS_RESIDUAL:  # rounded to the sum's dtype (x + residual may promote, e.g. bf16 + fp32 under autocast)
                normed = (h * rstd[:, None]).to(RES_OUT.dtype.element_ty).to(tl.float32)
            else:
                normed = (h * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            y = normed * w[None, :]
            if HAS_GATE:
                if not PRODUCT_FP32:
                    y = y.to(X.dtype.element_ty).to(tl.float32)
                g = tl.load(G + _row_offsets(rows, H, sg_m, sg_h)[:, None] + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                y = y * (g / (1.0 + tl.exp(-g)))
        if HAS_ADD:
            if ROUND_NORM:
                y = y.to(X.dtype.element_ty).to(tl.float32)
            y = y + tl.load(G + _row_offsets(rows, H, sg_m, sg_h)[:, None] + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
        tl.store(OUT + dense, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_backward_kernel(DY, S, W, RSTD, DRES, DX, DW, n_rows, H, ss_m, ss_h, N: tl.constexpr,
                                  N_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_DRES: tl.constexpr,
                                  OFFSET: tl.constexpr):
        """dx = rstd * (dy*w - normed * mean(dy*w*normed)) (+ the residual stream's gradient); each program
        strides over row blocks and writes its partial sum of dy * normed to its own row of DW."""
        pid = tl.program_id(0)
        cols = tl.arange(0, N_PAD)
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
        dw = tl.zeros([N_PAD], dtype=tl.float32)
        for block in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
            rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            mask = (rows < n_rows)[:, None] & col_ok[None, :]
            dense = rows[:, None] * N + cols[None, :]
            h = tl.load(S + _row_offsets(rows, H, ss_m, ss_h)[:, None] + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
            dy = tl.load(DY + dense, mask=mask, other=0.0).to(tl.float32)
            normed = h * rstd[:, None]
            dn = dy * w[None, :]
            dx = rstd[:, None] * (dn - normed * (tl.sum(dn * normed, 1) / N)[:, None])
            if HAS_DRES:
                dx += tl.load(DRES + dense, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + dense, dx.to(DX.dtype.element_ty), mask=mask)
            if OFFSET != 0.0:
                dw += tl.sum(dy * normed, 0)
            else:
                dw += tl.sum(dy * normed.to(S.dtype.element_ty).to(tl.float32), 0)
        tl.store(DW + pid * N + cols, dw, mask=col_ok)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, H, N] with unit stride along N, a view wherever x's layout allows one."""
    x3 = x.reshape(-1, x.shape[-2] if x.dim() >= 3 else 1, x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _block_rows(n_pad: int) -> int:
    return max(1, min(64, 8192 // n_pad))


def _norm_dtype(total: torch.dtype, weight_dtype: torch.dtype, rounded_to_x: bool) -> torch.dtype:
    """The norm's output dtype, as the unfused ops give it: the input's (x + residual) where the product is rounded
    to it (Gemma's offset form, the gated form), else the input's promoted with the weight's."""
    return total if rounded_to_x else torch.promote_types(total, weight_dtype)


def rms_norm_triton(x, weight, eps, residual=None, store_rstd: bool = False, offset: float = 0.0, gate=None,
                    x_scale: float = 1.0, add_to=None):
    """As rms_norm_reference; with store_rstd, also returns the fp32 1/rms of each row (for backward)."""
    shape, n = x.shape, x.shape[-1]
    x3 = _as_rows(x)
    rows = x3.shape[0] * x3.shape[1]
    total = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype  # x + residual
    product = torch.promote_types(total, weight.dtype)
    norm_dtype = _norm_dtype(total, weight.dtype, offset or gate is not None)
    out_dtype = norm_dtype if add_to is None else torch.promote_types(norm_dtype, add_to.dtype)
    out = torch.empty(shape, dtype=out_dtype, device=x.device)
    r3 = _as_rows(residual) if residual is not None else x3
    if gate is not None and (residual is not None or offset or gate.shape != shape):
        raise ValueError(f"a gated RMSNorm takes a gate of x's shape {tuple(shape)} and no residual or offset")
    if add_to is not None and (residual is not None or gate is not None or add_to.shape != shape):
        raise ValueError(f"an RMSNorm added to a residual stream takes add_to of x's shape {tuple(shape)} and no "
                         "residual or gate")
    operand = gate if gate is not None else add_to  # the G pointer: the gate, or the addend
    g3 = _as_rows(operand) if operand is not None else x3
    res_out = torch.empty(shape, dtype=total, device=x.device) if residual is not None else out
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    n_pad = next_pow2(n)
    br = _block_rows(n_pad)
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x3, r3, weight, g3, out, res_out, rstd, rows, x3.shape[1], x3.stride(0), x3.stride(1), r3.stride(0),
        r3.stride(1), g3.stride(0), g3.stride(1), eps, float(x_scale), N=n, N_PAD=n_pad, BLOCK_ROWS=br,
        HAS_RESIDUAL=residual is not None, OFFSET=float(offset), HAS_GATE=gate is not None,
        PRODUCT_FP32=product == torch.float32 != total, X_SCALED=residual is not None and x_scale != 1.0,
        HAS_ADD=add_to is not None, ROUND_NORM=norm_dtype != torch.float32)
    result = out if residual is None else (out, res_out)
    return (result, rstd) if store_rstd else result


def _backward_programs(device: torch.device, blocks: int) -> int:
    return max(1, min(blocks, 4 * num_sms(device, cpu=4)))


def rms_norm_backward_triton(dy, s, weight, rstd, dres=None, offset: float = 0.0):
    """(dx, dweight) of rms_norm at the pre-norm input s (x + residual), given the output's gradient dy and,
    with the residual form, the gradient dres of the returned residual stream (it passes through to dx)."""
    n = s.shape[-1]
    s3 = _as_rows(s)
    rows = s3.shape[0] * s3.shape[1]
    dy = dy.contiguous()
    dres = dres.contiguous() if dres is not None else dy
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    n_pad = next_pow2(n)
    br = _block_rows(n_pad)
    programs = _backward_programs(s.device, triton.cdiv(rows, br))
    dw = torch.empty(programs, n, dtype=torch.float32, device=s.device)
    _rms_norm_backward_kernel[(programs,)](dy, s3, weight, rstd, dres, dx, dw, rows, s3.shape[1], s3.stride(0),
                                           s3.stride(1), N=n, N_PAD=n_pad, BLOCK_ROWS=br,
                                           HAS_DRES=dres is not dy, OFFSET=float(offset))
    return dx, dw.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual, offset=0.0, x_scale=1.0, add_to=None):
        result, rstd = rms_norm_triton(x, weight, eps, residual, store_rstd=True, offset=offset, x_scale=x_scale,
                                       add_to=add_to)
        ctx.has_residual, ctx.offset = residual is not None, offset
        # add_to + norm: the norm's gradient arrives in the norm's own dtype, as the unfused add hands it on
        ctx.norm_dtype = None if add_to is None else _norm_dtype(x.dtype, weight.dtype, bool(offset))
        ctx.add_dtype = None if add_to is None else add_to.dtype
        ctx.x_scale = x_scale if residual is not None else 1.0  # x is scaled only where a residual is added
        ctx.save_for_backward(result[1] if ctx.has_residual else x, weight, rstd)
        ctx.set_materialize_grads(False)
        return result

    @staticmethod
    def backward(ctx, dout, dres=None):
        s, weight, rstd = ctx.saved_tensors
        if dout is None:  # only the residual stream was used
            ds, dw = dres, None
        else:
            dy = dout if ctx.norm_dtype is None else dout.to(ctx.norm_dtype)
            ds, dw = rms_norm_backward_triton(dy, s, weight, rstd, dres, ctx.offset)
        dx = ds if ctx.x_scale == 1.0 else ds * ctx.x_scale  # the gradient of x * x_scale, as torch's multiply's
        dadd = None if ctx.add_dtype is None or dout is None else dout.to(ctx.add_dtype)
        return dx, dw if ctx.needs_input_grad[1] else None, None, ds if ctx.has_residual else None, None, None, dadd


class GatedRMSNormFunction(torch.autograd.Function):
    """The gated form's backward: the gate's share in PyTorch over the recomputed w * normed, then the plain
    form's kernel for x and the weight."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        out, rstd = rms_norm_triton(x, weight, eps, store_rstd=True, gate=gate)
        ctx.eps = eps
        ctx.save_for_backward(x, weight, gate, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, gate, rstd = ctx.saved_tensors
        y = rms_norm_triton(x, weight, ctx.eps)  # w * normed, rounded as the forward rounded it
        g, d = gate.float(), dout.float()
        sig = torch.sigmoid(g)
        dgate = d * y.float() * sig * (1 + g * (1 - sig))
        dx, dw = rms_norm_backward_triton((d * g * sig).to(y.dtype), x, weight, rstd)
        return (dx, dw if ctx.needs_input_grad[1] else None, dgate.to(gate.dtype) if ctx.needs_input_grad[2] else None,
                None)


def rms_norm(x, weight, eps, residual=None, offset: float = 0.0, gate=None, x_scale: float = 1.0, add_to=None):
    """Triton on CUDA (with its backward when gradients are recorded); the PyTorch reference elsewhere."""
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, residual, offset, gate, x_scale, add_to)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, weight, residual, gate, add_to))
    if gate is not None:
        return GatedRMSNormFunction.apply(x, weight, gate, eps) if needs_grad else rms_norm_triton(x, weight, eps,
                                                                                                  gate=gate)
    if needs_grad:
        return RMSNormFunction.apply(x, weight, eps, residual, offset, x_scale, add_to)
    return rms_norm_triton(x, weight, eps, residual, offset=offset, x_scale=x_scale, add_to=add_to)
