"""LoRA's update of a fused projection's output at decode sizes, y += scaling * (x A^T) B^T for each adapted part,
in two launches whatever the number of parts: `shrink` computes x A^T for all parts at once in slices of K (fp32
partial sums), and `expand` sums the slices and adds each part's B to its columns of y, in place. In PyTorch the same
update is a GEMM for x A^T (cuBLAS splits K and reduces in a kernel of its own at decode sizes) and one GEMM per
part, so a Llama layer with every projection adapted ran 11 small kernels beside its 4 base GEMMs at each decode
step.

The adapter's layout is `rlcu/models/lora.py`'s: A [parts * r, K], the parts' rows stacked; B [adapted rows, r];
`rows` [N] gives each output column its row of B (-1: a part without an adapter), `firsts` [N] the first column of
x A^T of that part. A and B may be wider than x (fp32 adapters under bf16 autocast): they are rounded to x's dtype,
as autocast does, and x A^T to x's dtype before B's GEMM."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton

MAX_ROWS = 128  # above this (prefills, training) the PyTorch GEMMs: expand reads x A^T's slices once a tile of N
K_SLICE = 512  # x A^T's K per shrink program: a few programs at decode sizes, each reading its slice of x once


def lora_update_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                          firsts: torch.Tensor, scaling: float) -> torch.Tensor:
    """y [M, N] += scaling * (x [M, K] A^T) B^T over the adapted columns, in place; returns y."""
    r = b.shape[1]
    h = (x @ a.to(x.dtype).t()).float()  # [M, parts * r], rounded to x's dtype as the GEMM gives it
    h = h.to(x.dtype).float()
    on = rows >= 0
    cols = firsts[on].long()[:, None] + torch.arange(r, device=x.device)  # [n, r]: each column's slice of h
    delta = (h[:, cols] * b[rows[on].long()].to(x.dtype).float()).sum(-1)  # [M, n]
    y[:, on] = (y[:, on].float() + scaling * delta).to(y.dtype)
    return y


if HAS_TRITON:
    @triton.jit
    def _shrink_kernel(X, A, P, M, K, SR, stride_xm, stride_a, stride_pk, stride_pm, k_slice,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        """Program (m tile, slice): x[m tile, slice] A[:, slice]^T into P[slice, m tile, :SR], in fp32."""
        pm = tl.program_id(0)
        ks = tl.program_id(1)
        m = pm * BM + tl.arange(0, BM)
        j = tl.arange(0, BN)
        mm = m < M
        jm = j < SR
        dt = X.dtype.element_ty
        acc = tl.zeros([BM, BN], tl.float32)
        k0 = ks * k_slice
        k1 = tl.minimum(k0 + k_slice, K)
        for kb in range(k0, k1, BK):
            k = kb + tl.arange(0, BK)
            km = k < k1
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            a = tl.load(A + j[None, :] * stride_a + k[:, None], mask=jm[None, :] & km[:, None], other=0.0)
            acc = tl.dot(x, a.to(dt), acc, input_precision=PRECISION)
        tl.store(P + ks * stride_pk + m[:, None] * stride_pm + j[None, :], acc, mask=mm[:, None] & jm[None, :])

    @triton.jit
    def _expand_kernel(Y, P, B, ROWS, FIRSTS, M, N, R, slices, stride_y, stride_pk, stride_pm, stride_b, scaling,
                       BM: tl.constexpr, BN: tl.constexpr, R_PAD: tl.constexpr, PRECISION: tl.constexpr):
        """Program (n tile, m tile): for each part with columns in the tile, x A^T's r columns of that part (the
        slices summed, rounded to y's dtype) times its rows of B, added to y's tile in fp32 and rounded once."""
        pn = tl.program_id(0)
        pm = tl.program_id(1)
        n = pn * BN + tl.arange(0, BN)
        m = pm * BM + tl.arange(0, BM)
        nm = n < N
        mm = m < M
        rows = tl.load(ROWS + n, mask=nm, other=-1)
        firsts = tl.load(FIRSTS + n, mask=nm, other=0)
        on = rows >= 0
        lo = tl.min(tl.where(on, firsts, 1 << 30), 0)
        hi = tl.max(tl.where(on, firsts, -1), 0)
        if hi >= 0:  # a tile of columns without an adapter is left as it is
            dt = Y.dtype.element_ty
            j = tl.arange(0, R_PAD)
            jm = j < R
            acc = tl.zeros([BM, BN], tl.float32)
            for first in range(lo, hi + 1, R):
                h = tl.zeros([BM, R_PAD], tl.float32)
                for ks in range(0, slices):
                    h += tl.load(P + ks * stride_pk + m[:, None] * stride_pm + (first + j)[None, :],
                                 mask=mm[:, None] & jm[None, :], other=0.0)
                sel = on & (firsts == first)
                b = tl.load(B + rows[None, :] * stride_b + j[:, None], mask=sel[None, :] & jm[:, None], other=0.0)
                acc = tl.dot(h.to(dt), b.to(dt), acc, input_precision=PRECISION)
            tile = Y + m[:, None] * stride_y + n[None, :]
            keep = mm[:, None] & on[None, :]
            y = tl.load(tile, mask=keep, other=0.0)
            tl.store(tile, (y.to(tl.float32) + scaling * acc).to(dt), mask=keep)


def lora_update_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                       firsts: torch.Tensor, scaling: float) -> torch.Tensor:
    """`lora_update_reference` in two launches; y [M, N] and x [M, K] with unit column stride."""
    (m, k), (sr, r), n = x.shape, (a.shape[0], b.shape[1]), y.shape[1]
    assert x.stride(1) == y.stride(1) == a.stride(1) == b.stride(1) == 1 and m <= MAX_ROWS
    bm = max(16, next_pow2(m))
    slices = -(-k // K_SLICE)
    partial = torch.empty(slices, m, sr, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _shrink_kernel[(-(-m // bm), slices)](x, a, partial, m, k, sr, x.stride(0), a.stride(0), partial.stride(0),
                                         partial.stride(1), K_SLICE, BM=bm, BN=max(16, next_pow2(sr)), BK=64,
                                         PRECISION=precision)
    _expand_kernel[(triton.cdiv(n, 128), -(-m // bm))](y, partial, b, rows, firsts, m, n, r, slices, y.stride(0),
                                                      partial.stride(0), partial.stride(1), b.stride(0),
                                                      float(scaling), BM=bm, BN=128, R_PAD=max(16, next_pow2(r)),
                                                      PRECISION=precision)
    return y
