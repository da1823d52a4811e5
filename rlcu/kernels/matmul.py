"""A batch-invariant linear layer: y = x @ w.T + b, where each output row's arithmetic does not depend on
how many rows the call has or where the row sits among them.

cuBLAS picks its kernel, its tiles and whether to split K by the problem's shape, so the same row
multiplied in a decode batch of 64 and in a training micro-batch of 30,000 rows is summed in different
orders and comes out different in the last bits. Here K is never split and is walked from 0, so a row's dot
products are the same sums wherever it is: the engine's decode and prefill and the trainer's forward round
alike (`exact_logprobs`, docs/engine.md). The tiles may follow M: the tensor cores add K in steps of 16 into
the accumulator in K's order whatever the tile's shape or its K width (`tl.dot` of a 128-wide K block is
eight such steps, of a 64-wide one four), so each output element is the same sequence of additions. Every
tile below gave the same bits as every other on the H200 (`benchmarks/exact_gemm.py`, docs/benchmarks.md),
and tests/kernels/test_matmul.py checks rows alone against rows in batches of other tile choices.

A LoRA adapter's update rides in the same launch (`low_rank`): after K, the program walks the adapter's rank
from 0 in steps of 16 into a second accumulator and adds it scaled, so an adapted projection is one launch
and its rows stay batch-invariant by the same argument.

The backward is cuBLAS: gradients need not be bitwise anything. Autocast is followed by hand (inputs cast to
the autocast dtype as `F.linear` under autocast would), since a Triton launch is invisible to it."""
from __future__ import annotations

from typing import NamedTuple

import torch

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton

BLOCK_M, BLOCK_K = 64, 64  # the tile of the shipped configuration before tiles followed M
BLOCK_R = 16  # a LoRA update's rank per step: tl.dot's smallest K, whatever the tile
GROUP_M = 8  # row tiles whose programs run together, sharing their rows of x in L2 (the kernel's comment)


def block_n(n: int) -> int:
    """Output columns per program of that configuration."""
    return 64 if n <= 4096 else 128


TRAINING_ROWS = 16384  # from here on, a training forward's (or a long prefill's) tiles


def tiles(m: int, n: int, k: int, element_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an [m, k] x [k, n] product: the fastest of those measured
    with the same bits at each size (benchmarks/exact_gemm.py on the H200). A decode step's few rows take narrow
    column tiles so that the weights stream through many programs; more rows take wide tiles for reuse, and a
    training forward's tens of thousands of rows 256-row tiles where the layer is not small (16-bit inputs: a
    256-row tile of fp32 does not fit in shared memory)."""
    if n >= 65536:  # the LM head: enough column tiles at any M
        return (64, 128, 64, 4, 3) if m <= 64 else (128, 256, 64, 8, 3)
    if m <= 64:
        bn = 16 if n <= 2048 else 32 if n <= 4096 else 64 if n <= 8192 else 128
        return 64, bn, 128, 4, 4
    if m >= TRAINING_ROWS and element_size <= 2:
        return (128, 128, 64, 8, 3) if n * k <= 1 << 21 else (256, 128, 64, 8, 3)
    if n <= 2048:
        return 64, (64 if n <= 1024 else 128), 128, 4, 4
    return 128, 128, 64, 8, 3


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] -> [M, N], accumulated in fp32 (fp64 for fp64) like the kernel."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ weight.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


if HAS_TRITON:
    @triton.jit
    def _linear_kernel(X, W, B, Y, H, L, M, N, K, R, stride_xm, stride_wn, stride_ym, stride_hm, stride_ln, scale,
                       HAS_BIAS: tl.constexpr, LOW_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr):
        # programs in groups of GROUP_M row tiles, each group walking every column tile: the rows of x a group
        # reads stay in L2 across the columns (x at training sizes is larger than L2). Only which program computes
        # a tile depends on it, never a tile's sums.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
        pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _dot_rows(X, W, rows, cols, M, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if LOW_RANK:  # + scale * h @ l.T, its own sums in rank order, added once
            acc += scale * _dot_rows(H, L, rows, cols, M, N, R, stride_hm, stride_ln, BLOCK_M, BLOCK_N, BLOCK_R,
                                     PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _dot_rows(X, W, rows, cols, M, N, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """x[rows] @ w[cols].T in fp32, K walked from 0 in BLOCK_K steps."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        return acc


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  low_rank: LowRank | None = None) -> torch.Tensor:
    """x [M, K] (last dim contiguous), weight [N, K] contiguous, all one dtype -> [M, N] in that dtype; with
    `low_rank` (h [M, R], l [N, R], scale): + scale * h @ l.T, in the same launch."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if low_rank is not None:
        low_rank = LowRank(low_rank.h.contiguous(), low_rank.l.contiguous(), low_rank.scale)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        launch(x, weight, bias, y, *tiles(m, n, k, x.element_size()), low_rank=low_rank)
    return y


class LowRank(NamedTuple):
    """A low-rank update added to a product's output: scale * h @ l.T (a LoRA adapter's A x, its B)."""
    h: torch.Tensor
    l: torch.Tensor  # noqa: E741
    scale: float


def launch(x, weight, bias, y, bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = GROUP_M,
           low_rank: LowRank | None = None) -> None:
    """One launch of the kernel with the given tile (benchmarks/exact_gemm.py times others)."""
    m, k = x.shape
    n = weight.shape[0]
    h, l_, scale = low_rank if low_rank is not None else (x, weight, 1.0)
    _linear_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, h, l_, m, n, k, h.shape[1] if low_rank is not None else 0,
        x.stride(0), weight.stride(0), y.stride(0), h.stride(0), l_.stride(0), scale,
        HAS_BIAS=bias is not None, LOW_RANK=low_rank is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_R=BLOCK_R, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_M=group_m,
        num_warps=warps, num_stages=stages)


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, h2d, l_, scale):
        ctx.save_for_backward(x2d, weight, h2d, l_)
        ctx.has_bias, ctx.scale = bias is not None, scale
        return linear_triton(x2d, weight, bias, None if h2d is None else LowRank(h2d, l_, scale))

    @staticmethod
    def backward(ctx, grad):
        x2d, weight, h2d, l_ = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x = grad @ weight if need[0] else None
        grad_w = grad.t() @ x2d if need[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and need[2] else None
        grad_h = (grad @ l_) * ctx.scale if need[3] else None
        grad_l = (grad.t() @ h2d) * ctx.scale if need[4] else None
        return grad_x, grad_w, grad_b, grad_h, grad_l, None


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     low_rank: LowRank | None = None) -> torch.Tensor:
    """`F.linear` whose rows are batch-invariant (module docstring); x [..., K]; `low_rank` (h [..., R], l [N, R],
    scale) adds scale * h @ l.T in the same launch. Needs the Triton kernel (a CUDA device, or RLCU_TRITON=1 with
    the interpreter)."""
    if not use_triton(x):
        raise RuntimeError("batch-invariant linear layers (exact_logprobs) need the Triton kernels: run on a CUDA "
                           "device, or set RLCU_TRITON=1 to use Triton's CPU interpreter")
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)  # what autocast does to F.linear's inputs (differentiable casts)
    bias = bias.to(dtype) if bias is not None else None
    h, l_, scale = low_rank if low_rank is not None else (None, None, 1.0)
    if h is not None:
        h, l_ = h.to(dtype).reshape(-1, h.shape[-1]), l_.to(dtype)
    with torch.autocast(kind, enabled=False):
        y = _InvariantLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, h, l_, scale)
    return y.view(*x.shape[:-1], weight.shape[0])
