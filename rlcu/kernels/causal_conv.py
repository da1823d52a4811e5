"""Gated DeltaNet's short causal convolution over whole sequences, forward and backward, in Triton: training's
and prefill's form of `gated_delta.causal_conv` (its reference, with its rounding: the sum in fp32 over the
weight rounded to x's dtype, rounded to x's dtype before SiLU), where torch's depthwise convolution runs several
times slower than its bytes (docs/benchmarks.md, the H100 profile at 9b7f1e8).

A program takes a block of tokens by a block of channels, flat over the sequences at `cu`: each token reads its
K - 1 predecessors within its own sequence, and before the sequence's first token its window (zeros without one).
The backward recomputes the pre-activation and writes its gradient in fp32, each program summing its share of the
weight's gradient over its blocks of tokens; a second pass gathers each input's gradient from the K outputs that
read it."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton

BLOCK_T = 16
BLOCKS_A_PROGRAM = 16  # the backward's blocks of tokens a program: its share of the weight's gradient in registers


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor,
                       window: torch.Tensor | None) -> torch.Tensor:
    """silu(conv(x)) over the sequences at `cu`: x [T, C] (rows at any stride), weight [C, K], `window`
    [N, C, K - 1] or None (zeros; no gradient reaches it) -> [T, C] in x's dtype."""
    return _CausalConv.apply(x, weight, cu, window)


def _tokens(cu: torch.Tensor, t: int):
    """Each token's sequence and its sequence's first and last-plus-one token, int32 [T] each."""
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=t)
    return seq.int(), cu[:-1].int()[seq], cu[1:].int()[seq]


def _grid(t: int, c: int, block_c: int):
    return triton.cdiv(t, BLOCK_T), triton.cdiv(c, block_c)


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu, window):
        t, c = x.shape
        k = weight.shape[1]
        x = x if x.stride(-1) == 1 else x.contiguous()
        weight = weight.contiguous()
        seq, start, end = _tokens(cu, t)
        window = window.contiguous() if window is not None else None
        win = window if window is not None else x  # a pointer the kernel does not read without a window
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
        block_c = min(128, next_pow2(c))
        if t:
            _conv_forward_kernel[_grid(t, c, block_c)](x, weight, win, seq, start, out, t, c, x.stride(0), K=k,
                                                       HAS_WINDOW=window is not None, BLOCK_T=BLOCK_T,
                                                       BLOCK_C=block_c)
        ctx.save_for_backward(x, weight, window, seq, start, end)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, window, seq, start, end = ctx.saved_tensors
        t, c = x.shape
        k = weight.shape[1]
        if not t:
            return torch.zeros_like(x), torch.zeros_like(weight), None, None
        dy = dy.contiguous()
        block_c = min(128, next_pow2(c))
        grid = _grid(t, c, block_c)
        blocks = min(BLOCKS_A_PROGRAM, grid[0])
        dpre = torch.empty(t, c, dtype=torch.float32, device=x.device)
        dw_parts = torch.empty(triton.cdiv(grid[0], blocks), c, k, dtype=torch.float32, device=x.device)
        dx = torch.empty(t, c, dtype=x.dtype, device=x.device)
        win = window if window is not None else x  # as in the forward
        _conv_backward_kernel[(len(dw_parts), grid[1])](x, weight, win, seq, start, dy, dpre, dw_parts, t, c,
                                                        x.stride(0), blocks, K=k, HAS_WINDOW=window is not None,
                                                        BLOCK_T=BLOCK_T, BLOCK_C=block_c, BLOCK_K=next_pow2(k))
        _conv_input_grad_kernel[grid](dpre, weight, end, dx, t, c, K=k, BLOCK_T=BLOCK_T, BLOCK_C=block_c)
        dw = dw_parts.sum(0)
        return dx, dw.to(weight.dtype), None, None


if HAS_TRITON:
    @triton.jit
    def _tap(X, WIN, ts, cs, tm, cm, seq, start, stride_x, c, j, K: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """The inputs tap j reads for tokens `ts`, channels `cs` (fp32): x at t - (K - 1) + j within the token's
        sequence, before it the window's, or zeros."""
        src = ts - (K - 1) + j
        inside = src >= start
        x = tl.load(X + src[:, None].to(tl.int64) * stride_x + cs[None, :],
                    mask=(tm & inside)[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if HAS_WINDOW:
            at = seq[:, None].to(tl.int64) * (c * (K - 1)) + cs[None, :] * (K - 1) + (src - start + K - 1)[:, None]
            before = tl.load(WIN + at, mask=(tm & (src < start))[:, None] & cm[None, :], other=0.0)
            x += before.to(X.dtype.element_ty).to(tl.float32)  # in x's dtype, as the reference lays it out
        return x

    @triton.jit
    def _pre(X, W, WIN, ts, cs, tm, cm, seq, start, stride_x, c, K: tl.constexpr, HAS_WINDOW: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """The pre-activation of tokens `ts`, channels `cs`: the taps' sum in fp32, rounded to x's dtype."""
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(W + cs * K + j, mask=cm, other=0.0).to(X.dtype.element_ty).to(tl.float32)
            acc += _tap(X, WIN, ts, cs, tm, cm, seq, start, stride_x, c, j, K, HAS_WINDOW) * w[None, :]
        return acc.to(X.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _conv_forward_kernel(X, W, WIN, SEQ, START, OUT, t, c, stride_x, K: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        tb, cb = tl.program_id(0), tl.program_id(1)
        ts = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        tm, cm = ts < t, cs < c
        seq = tl.load(SEQ + ts, mask=tm, other=0)
        start = tl.load(START + ts, mask=tm, other=0)
        pre = _pre(X, W, WIN, ts, cs, tm, cm, seq, start, stride_x, c, K, HAS_WINDOW, BLOCK_T, BLOCK_C)
        out = pre / (1.0 + tl.exp(-pre))
        tl.store(OUT + ts[:, None].to(tl.int64) * c + cs[None, :], out.to(OUT.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])

    @triton.jit
    def _conv_backward_kernel(X, W, WIN, SEQ, START, DY, DPRE, DW, t, c, stride_x, blocks, K: tl.constexpr,
                              HAS_WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """`blocks` blocks of tokens a program: DPRE (fp32) the pre-activation's gradient from DY, and DW [programs
        along T, C, K] the program's share of the weight's gradient, summed over its blocks in registers."""
        pb, cb = tl.program_id(0), tl.program_id(1)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        ks = tl.arange(0, BLOCK_K)
        cm = cs < c
        dw = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
        for b in range(blocks):
            ts = (pb * blocks + b) * BLOCK_T + tl.arange(0, BLOCK_T)
            tm = ts < t
            seq = tl.load(SEQ + ts, mask=tm, other=0)
            start = tl.load(START + ts, mask=tm, other=0)
            pre = _pre(X, W, WIN, ts, cs, tm, cm, seq, start, stride_x, c, K, HAS_WINDOW, BLOCK_T, BLOCK_C)
            sig = 1.0 / (1.0 + tl.exp(-pre))
            at = ts[:, None].to(tl.int64) * c + cs[None, :]
            m = tm[:, None] & cm[None, :]
            dpre = tl.load(DY + at, mask=m, other=0.0).to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))
            tl.store(DPRE + at, dpre, mask=m)
            for j in tl.static_range(K):
                part = tl.sum(dpre * _tap(X, WIN, ts, cs, tm, cm, seq, start, stride_x, c, j, K, HAS_WINDOW), 0)
                dw += tl.where(ks[None, :] == j, part[:, None], 0.0)
        tl.store(DW + (pb * c + cs[:, None]) * K + ks[None, :], dw, mask=cm[:, None] & (ks[None, :] < K))

    @triton.jit
    def _conv_input_grad_kernel(DPRE, W, END, DX, t, c, K: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_C: tl.constexpr):
        """dx at token s: the K outputs s .. s + K - 1 of its own sequence read it, output s + K - 1 - j by tap j."""
        tb, cb = tl.program_id(0), tl.program_id(1)
        ts = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        tm, cm = ts < t, cs < c
        end = tl.load(END + ts, mask=tm, other=0)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(W + cs * K + j, mask=cm, other=0.0).to(DX.dtype.element_ty).to(tl.float32)
            dst = ts + (K - 1 - j)
            d = tl.load(DPRE + dst[:, None].to(tl.int64) * c + cs[None, :],
                        mask=(tm & (dst < end))[:, None] & cm[None, :], other=0.0)
            acc += d * w[None, :]
        tl.store(DX + ts[:, None].to(tl.int64) * c + cs[None, :], acc.to(DX.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])
