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

A LoRA adapter's update rides in the same launch (`LowRank`): the product rounded to the output's dtype, then
scale * h B^T added, B's rows gathered per output column (a fused q/k/v projection's parts each meet their own
slice of h, as a block-diagonal B would) and the rank walked from 0 in steps of 16; the rows stay
batch-invariant by the same argument. Rounding the product first lets training add the update in a kernel of
its own (`add_low_rank`) after the vendor's GEMM, to the same bits.

From a thousand rows (training's forwards and LM-head chunks, long prefills) cuBLAS is faster, and at the shapes
measured it gave the kernel's bits (docs/benchmarks.md); it picks its kernel (and whether to split K) by shape,
so each shape is checked before it is trusted (`VendorCheck`): its output at one row in every 16 and the last
against the kernel's, once a shape.

The backward is cuBLAS: gradients need not be bitwise anything; so is a checkpointed layer's recompute, unchecked
(`rlcu.kernels._recompute`: its values only feed the backward). Autocast is followed by hand (inputs cast to
the autocast dtype as `F.linear` under autocast would), since a Triton launch is invisible to it."""
from __future__ import annotations

from typing import NamedTuple

import torch

from rlcu.kernels._recompute import recomputing
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
    def _row_sums(X, W, rows, cols, row_end, N, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """x[rows] @ w[cols].T in fp32 (rows from `row_end` on and cols from N on read as zero): K walked from 0 in
        BLOCK_K steps, the sums every kernel here gives a row, wherever it sits."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=(rows[:, None] < row_end) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _linear_kernel(X, W, B, Y, H, L, LROW, LCOL, M, N, K, R, RANK, stride_xm, stride_wn, stride_ym, stride_hm,
                       stride_ln, scale, HAS_BIAS: tl.constexpr, LOW_RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                       GROUP_M: tl.constexpr):
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
        acc = _row_sums(X, W, rows, cols, M, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if LOW_RANK:
            acc = _plus_low_rank(acc.to(Y.dtype.element_ty), H, L, LROW, LCOL, rows, cols, M, N, R, RANK, stride_hm,
                                 stride_ln, scale, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _plus_low_rank(base, H, L, LROW, LCOL, rows, cols, M, N, R, RANK, stride_hm, stride_ln, scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
        """base (rounded to the output's dtype) + scale * h[rows] @ Bbd[cols].T in fp32, where column n's row of the
        block-diagonal Bbd is l[LROW[n]] at h's columns LCOL[n]..LCOL[n] + RANK and zero elsewhere (LROW -1: all
        zero), gathered here, never built; h's columns walked from 0 in BLOCK_R steps."""
        lrow = tl.load(LROW + cols, mask=cols < N, other=-1)
        lcol = tl.load(LCOL + cols, mask=cols < N, other=0)
        js = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j0 in range(0, R, BLOCK_R):
            jj = j0 + js
            h = tl.load(H + rows[:, None].to(tl.int64) * stride_hm + jj[None, :],
                        mask=(rows[:, None] < M) & (jj[None, :] < R), other=0.0)
            j = jj[None, :] - lcol[:, None]
            w = tl.load(L + lrow[:, None].to(tl.int64) * stride_ln + j,
                        mask=(lrow[:, None] >= 0) & (j >= 0) & (j < RANK), other=0.0)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        return base.to(tl.float32) + scale * acc

    @triton.jit
    def _add_low_rank_kernel(C, H, L, LROW, LCOL, Y, M, N, R, RANK, stride_cm, stride_hm, stride_ln, stride_ym,
                             scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        base = tl.load(C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], mask=inside, other=0.0)
        acc = _plus_low_rank(base, H, L, LROW, LCOL, rows, cols, M, N, R, RANK, stride_hm, stride_ln, scale,
                             BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _grouped_linear_kernel(X, W, ENDS, Y, N, K, G, stride_xm, stride_wg, stride_wn, stride_ym,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_G: tl.constexpr, PRECISION: tl.constexpr):
        # row tile t belongs to the group whose range of tiles holds it (each group's row tiles, cumulative, made
        # here from the ends: a few hundred integers, where a launch of their own costs more); past the last
        # group's tiles a program has nothing to do. A tile's rows are its group's only, and each row's sums walk
        # K from 0 as the single kernel's do: where a row sits changes nothing.
        t = tl.program_id(0)
        gs = tl.arange(0, BLOCK_G)
        ends = tl.load(ENDS + gs, mask=gs < G, other=0)
        starts = tl.load(ENDS + gs - 1, mask=(gs > 0) & (gs < G), other=0)
        tile_ends = tl.cumsum((ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        g = tl.sum(((tile_ends <= t) & (gs < G)).to(tl.int32), 0)
        if g < G:
            first_tile = tl.sum(tl.where(gs == g - 1, tile_ends, 0), 0)
            start = tl.sum(tl.where(gs == g, starts, 0), 0)
            end = tl.sum(tl.where(gs == g, ends, 0), 0)
            rows = start + (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _row_sums(X, W + g.to(tl.int64) * stride_wg, rows, cols, end, N, K, stride_xm, stride_wn, BLOCK_M,
                            BLOCK_N, BLOCK_K, PRECISION)
            tl.store(Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rows[:, None] < end) & (cols[None, :] < N))


class LowRank(NamedTuple):
    """A low-rank update added to a product's rounded output: scale * h @ Bbd.T, h [M, R] (a LoRA adapter's A x),
    Bbd [N, R] block-diagonal, given as B's rows `l` [rows, rank] and two int32 maps over the N output columns:
    `rows` (the row of l that column n takes, -1 for none) and `firsts` (the column of h where it starts)."""
    h: torch.Tensor
    l: torch.Tensor  # noqa: E741
    scale: float
    rows: torch.Tensor
    firsts: torch.Tensor

    @staticmethod
    def dense(h: torch.Tensor, l: torch.Tensor, scale: float) -> "LowRank":  # noqa: E741
        """Bbd = l itself ([N, R]): every column takes its own row of l over all of h."""
        n = l.shape[0]
        return LowRank(h, l, scale, torch.arange(n, dtype=torch.int32, device=l.device),
                       torch.zeros(n, dtype=torch.int32, device=l.device))

    def block_diagonal(self) -> torch.Tensor:
        """Bbd [N, R], differentiable in l (the backward's GEMMs take it whole)."""
        n, rank = self.rows.shape[0], self.l.shape[1]
        cols = torch.nonzero(self.rows >= 0).squeeze(1)
        where = self.firsts[cols].long()[:, None] + torch.arange(rank, device=cols.device)
        out = self.l.new_zeros(n, self.h.shape[-1])
        return out.index_put((cols[:, None].expand_as(where), where), self.l[self.rows[cols].long()])

    def contiguous(self) -> "LowRank":
        return self._replace(h=self.h.contiguous(), l=self.l.contiguous())


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  low_rank: LowRank | None = None) -> torch.Tensor:
    """x [M, K] (last dim contiguous), weight [N, K] contiguous, all one dtype -> [M, N] in that dtype; with
    `low_rank`: its update added to the rounded product, in the same launch."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        launch(x, weight, bias, y, *tiles(m, n, k, x.element_size()),
               low_rank=None if low_rank is None else low_rank.contiguous())
    return y


def launch(x, weight, bias, y, bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = GROUP_M,
           low_rank: LowRank | None = None) -> None:
    """One launch of the kernel with the given tile (benchmarks/exact_gemm.py times others)."""
    m, k = x.shape
    n = weight.shape[0]
    lr = low_rank if low_rank is not None else LowRank(x, weight, 1.0, y, y)
    _linear_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, lr.h, lr.l, lr.rows, lr.firsts, m, n, k,
        lr.h.shape[1] if low_rank is not None else 0, lr.l.shape[1], x.stride(0), weight.stride(0), y.stride(0),
        lr.h.stride(0), lr.l.stride(0), lr.scale, HAS_BIAS=bias is not None, LOW_RANK=low_rank is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=BLOCK_R, PRECISION=_precision(x), GROUP_M=group_m,
        num_warps=warps, num_stages=stages)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def add_low_rank(base: torch.Tensor, low_rank: LowRank) -> torch.Tensor:
    """base [M, N] + the update, as the fused launch adds it to its rounded product: the same bits."""
    lr = low_rank.contiguous()
    base = base.contiguous()
    (m, n), bm, bn = base.shape, 64, 64
    y = torch.empty_like(base)
    if m:
        _add_low_rank_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            base, lr.h, lr.l, lr.rows, lr.firsts, y, m, n, lr.h.shape[1], lr.l.shape[1], base.stride(0),
            lr.h.stride(0), lr.l.stride(0), y.stride(0), lr.scale, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=BLOCK_R,
            PRECISION=_precision(base), num_warps=4)
    return y


class VendorCheck:
    """Which shapes the vendor's GEMM (`F.linear`: cuBLAS) computes to the kernel's bits. A shape's first product
    runs the vendor's GEMM, and the kernel on one row in every 16 and the last (a row in each of the vendor's row
    tiles, which are 16 rows or more, each compared over every column tile); equal there, the shape keeps the
    vendor's GEMM, else the kernel. A split K (whole or on some tiles) changes nearly every element it touches,
    so it cannot pass. Shapes: the inputs' sizes, strides, dtype and 16-byte alignment, and the bias.
    NaN inputs fail the check (NaN is unequal to itself), which keeps the kernel: the safe side."""

    STRIDE = 16
    KEEP = 4096  # verdicts kept (a run of many lengths makes many shapes); past it they are checked afresh

    def __init__(self):
        self.verdicts: dict[tuple, bool] = {}

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        key = (x.shape, x.stride(), weight.shape, weight.stride(), x.dtype, x.device, bias is not None,
               x.data_ptr() % 16, weight.data_ptr() % 16)
        verdict = self.verdicts.get(key)
        if verdict is None and len(self.verdicts) >= self.KEEP:
            self.verdicts.clear()
        if verdict is False:
            return linear_triton(x, weight, bias)
        y = vendor_linear(x, weight, bias)
        if verdict is None:
            m = x.shape[0]
            rows = torch.cat([torch.arange(self.STRIDE // 2, m, self.STRIDE), torch.tensor([m - 1])]).to(x.device)
            verdict = self.verdicts[key] = bool(torch.equal(y[rows], linear_triton(x[rows], weight, bias)))
            if not verdict:
                return linear_triton(x, weight, bias)
        return y


def vendor_linear(x, weight, bias=None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


VENDOR = VendorCheck()


VENDOR_ROWS = 1024  # from here on the vendor's GEMM is worth a check (a decode step's rows stay on the kernel)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   low_rank: LowRank | None = None, vendor: bool = True) -> torch.Tensor:
    """The batch-invariant product of 2-D x: the kernel, or from VENDOR_ROWS rows the vendor's GEMM where its
    shape gave the kernel's bits (the update then added by its own kernel). Never while a CUDA graph is being
    captured (the check reads its verdict on the host), nor where the caller says `vendor=False`."""
    vendor = vendor and (not torch.cuda.is_current_stream_capturing() if x.is_cuda else VENDOR_ON_CPU)
    if x.shape[0] < VENDOR_ROWS or not vendor:
        return linear_triton(x, weight, bias, low_rank)
    y = VENDOR.linear(x, weight, bias)
    return y if low_rank is None else add_low_rank(y, low_rank)


VENDOR_ON_CPU = False  # the tests turn it on: the interpreter's kernel against torch's CPU GEMM


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, h2d, l_, rows, firsts, scale, vendor):
        low_rank = None if h2d is None else LowRank(h2d, l_, scale, rows, firsts)
        ctx.save_for_backward(x2d, weight, h2d, l_, rows, firsts)
        ctx.has_bias, ctx.scale = bias is not None, scale
        if recomputing():  # values only the backward reads (rlcu.kernels._recompute): the vendor's GEMM, unchecked
            y = vendor_linear(x2d, weight, bias)
            return y if low_rank is None else add_low_rank(y, low_rank)
        return invariant_gemm(x2d, weight, bias, low_rank, vendor)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight, h2d, l_, rows, firsts = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x = grad @ weight if need[0] else None
        grad_w = grad.t() @ x2d if need[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and need[2] else None
        grad_h = grad_l = None
        if h2d is not None and (need[3] or need[4]):
            with torch.enable_grad():
                l_leaf = l_.detach().requires_grad_()
                bd = LowRank(h2d, l_leaf, ctx.scale, rows, firsts).block_diagonal()
            grad_h = (grad @ bd.detach()) * ctx.scale if need[3] else None
            if need[4]:
                grad_l, = torch.autograd.grad(bd, l_leaf, (grad.t() @ h2d) * ctx.scale)
        return grad_x, grad_w, grad_b, grad_h, grad_l, None, None, None, None


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     low_rank: LowRank | None = None, vendor: bool = True) -> torch.Tensor:
    """`F.linear` whose rows are batch-invariant (module docstring); x [..., K]; `low_rank` (h [..., R]) adds its
    update to the rounded product. `vendor=False`: always the kernel, for a caller whose row counts change at
    every call (an expert's rows), where a check a call would cost more than it saves. Needs the Triton kernel (a
    CUDA device, or RLCU_TRITON=1 with the interpreter)."""
    if not use_triton(x):
        raise RuntimeError("batch-invariant linear layers (exact_logprobs) need the Triton kernels: run on a CUDA "
                           "device, or set RLCU_TRITON=1 to use Triton's CPU interpreter")
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)  # what autocast does to F.linear's inputs (differentiable casts)
    bias = bias.to(dtype) if bias is not None else None
    lr = (None,) * 4 + (1.0,)
    if low_rank is not None:
        lr = (low_rank.h.to(dtype).reshape(-1, low_rank.h.shape[-1]), low_rank.l.to(dtype), low_rank.rows,
              low_rank.firsts, low_rank.scale)
    with torch.autocast(kind, enabled=False):
        y = _InvariantLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, *lr, vendor)
    return y.view(*x.shape[:-1], weight.shape[0])


def grouped_tile(m: int, groups: int, element_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a grouped launch of m rows: 128 x 128 tiles where the groups
    average 128 rows or more in 16 bits (a training forward), else 64 x 64 (a decode step's few rows an expert).
    Like `tiles`, it follows the rows without touching a row's sums."""
    return (128, 128, 64, 8, 3) if m >= 128 * groups and element_size <= 2 else (64, 64, 64, 4, 3)


class GroupRows:
    """Rows sorted by group: `counts` [G] on the device, and what a grouped launch reads of them (the cumulative
    ends, int32), made once for every launch over the same rows: an MoE layer's two projections and their
    adapters' four."""

    def __init__(self, counts: torch.Tensor, ends: torch.Tensor | None = None):
        self.counts = counts
        self._ends = ends  # where the caller has them already (the MoE dispatch kernel writes them)

    def ends(self) -> torch.Tensor:
        if self._ends is None:
            self._ends = self.counts.cumsum(0, dtype=torch.int32)
        return self._ends


def grouped_linear_triton(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | GroupRows,
                          tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] sorted by group, weight [G, N, K], counts [G] (on x's device) -> [M, N], x_g @ weight_g.T for each
    group in one launch: the counts are read on the device (CUDA-graph safe), and each row's sums are those of
    `linear_triton` on that row alone (module docstring). `tile`: `grouped_tile`'s choice by default
    (benchmarks/grouped_gemm.py times others)."""
    m, k = x.shape
    g, n, _ = weight.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = tile or grouped_tile(m, g, x.element_size())
    if m and g:
        groups = counts if isinstance(counts, GroupRows) else GroupRows(counts)
        _grouped_linear_kernel[(triton.cdiv(m, bm) + g, triton.cdiv(n, bn))](
            x, weight, groups.ends(), y, n, k, g, x.stride(0), weight.stride(0),
            weight.stride(1), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_G=triton.next_power_of_2(g), PRECISION=_precision(x),
            num_warps=warps, num_stages=stages)
    return y


def invariant_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | GroupRows) -> torch.Tensor:
    """`grouped_linear_triton` with autocast followed by hand, differentiable (the backward group by group: gradients
    need not be bitwise anything). Needs the Triton kernel, as `invariant_linear` does."""
    if not use_triton(x):
        raise RuntimeError("batch-invariant linear layers (exact_logprobs) need the Triton kernels: run on a CUDA "
                           "device, or set RLCU_TRITON=1 to use Triton's CPU interpreter")
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    with torch.autocast(kind, enabled=False):
        groups = counts if isinstance(counts, GroupRows) else GroupRows(counts)
        return _InvariantGroupedLinear.apply(x.to(dtype), weight.to(dtype), groups.counts, groups)


class _InvariantGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, groups):
        ctx.save_for_backward(x, weight, counts)
        return grouped_linear_triton(x, weight, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight, counts = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x = torch.zeros_like(x) if need[0] else None
        grad_w = torch.zeros_like(weight) if need[1] else None
        start = 0
        for g, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                if need[0]:
                    grad_x[rows] = grad[rows] @ weight[g]
                if need[1]:
                    grad_w[g] = grad[rows].t() @ x[rows]
            start += n
        return grad_x, grad_w, None, None
