"""Causal attention over sequences laid out in the rows of one tensor, forward and backward, with what flash and
SDPA kernels leave out: soft-capped scores (Gemma 2) and attention sinks (gpt-oss), beside sliding windows and GQA.
`rlcu/kernels/sdpa.py` is the reference.

Sequence i holds rows starts[i] .. ends[i] - 1 of q/k/v [T, H, D]: packed sequences one after another, or the rows
of a padded batch flattened (each row's tokens between its padding). Rows outside every sequence give 0 and get no
gradient.

Triton (forward and backward, FlashAttention-2's scheme): the forward keeps each row's log-sum-exp, the sink's
share included, so the backward recomputes the probabilities tile by tile; one program a (tile of keys, KV head)
sums dK and dV over the tiles of queries that see it and over the group's query heads, one a (tile of queries,
query head) sums dQ. A sink's gradient is -sum over rows of its probability times rowsum(dO * O)."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton

BLOCK = 32  # queries, and keys, a tile


def varlen_tiles(starts: torch.Tensor, ends: torch.Tensor, device) -> torch.Tensor:
    """The kernels' work list for sequences at rows starts[i] .. ends[i] - 1 (int, on the host): [tiles, 3] int32 on
    `device`, (first row, the sequence's start, its end) for every BLOCK rows of every sequence. Made once for all
    the layers of a forward."""
    starts, ends = torch.as_tensor(starts).long().cpu(), torch.as_tensor(ends).long().cpu()
    count = (ends - starts).clamp(min=0).add(BLOCK - 1).div(BLOCK, rounding_mode="floor")
    seq = torch.repeat_interleave(torch.arange(len(starts)), count)
    within = torch.arange(len(seq)) - torch.repeat_interleave(count.cumsum(0) - count, count)
    tiles = torch.stack([starts[seq] + within * BLOCK, starts[seq], ends[seq]], 1)
    return (tiles if len(tiles) else torch.zeros(1, 3, dtype=torch.long)).to(device, torch.int32)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor,
                     scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (Hkv divides Hq); `tiles`: `varlen_tiles` of the sequences' rows; `window`: a
    query sees the keys less than `window` before it; `sinks` [Hq]; `softcap` the scores' cap -> [T, Hq, D], with
    gradients for q, k, v and sinks."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _VarlenAttention.apply(q, k, v, sinks, tiles, scale, window, softcap)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, tiles, scale, window, softcap):
        o, lse = _forward(q, k, v, sinks, tiles, scale, window, softcap)
        ctx.save_for_backward(q, k, v, sinks, o, lse, tiles)
        ctx.scale, ctx.window, ctx.softcap = scale, window, softcap
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, o, lse, tiles = ctx.saved_tensors
        grad = grad.contiguous()
        delta = (grad.float() * o.float()).sum(-1)  # [T, Hq]: rowsum(dO * O)
        dq, dk, dv = _backward(q, k, v, grad, lse, delta, tiles, ctx.scale, ctx.window, ctx.softcap)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            share = torch.exp(sinks.float()[None] - lse).masked_fill(lse == float("-inf"), 0.0)  # rows in no sequence
            dsinks = -(share * delta).sum(0).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def _args(q, k, window, softcap):
    d, block_d = q.shape[-1], max(16, next_pow2(q.shape[-1]))
    return dict(group=q.shape[1] // k.shape[1], hq=q.shape[1], hkv=k.shape[1], d=d, window=window or 0,
                CAP=softcap or 0.0, BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_D=block_d,
                num_warps=8 if block_d >= 128 else 4)  # wide heads: the fp32 accumulators over more registers


def _forward(q, k, v, sinks, tiles, scale, window, softcap):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    sink = sinks.float().contiguous() if sinks is not None else lse  # not read without HAS_SINKS
    _fwd_kernel[(len(tiles), q.shape[1])](q, k, v, o, lse, sink, tiles, scale, HAS_SINKS=sinks is not None,
                                          **_args(q, k, window, softcap))
    return o, lse


def _backward(q, k, v, do, lse, delta, tiles, scale, window, softcap):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    args = _args(q, k, window, softcap)
    _bwd_kv_kernel[(len(tiles), k.shape[1])](q, k, v, do, lse, delta, dk, dv, tiles, scale, **args)
    _bwd_q_kernel[(len(tiles), q.shape[1])](q, k, v, do, lse, delta, dq, tiles, scale, **args)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


if HAS_TRITON:
    from rlcu.kernels._paged_kv import soft_cap

    @triton.jit
    def _scores(q, kt, ms, ns, lo, hi, scale, window, CAP: tl.constexpr):
        """A tile's scores [M, N] in fp32, capped where CAP, -inf where a query does not see a key; and tanh of the
        capped scores' argument (for the backward; 0 without CAP)."""
        s = tl.dot(q, kt).to(tl.float32) * scale
        t = s * 0.0
        if CAP > 0:
            s = soft_cap(s, CAP)
            t = s / CAP
        seen = (ns[None, :] <= ms[:, None]) & (ns[None, :] >= lo) & (ns[None, :] < hi) & (ms[:, None] < hi)
        if window > 0:
            seen = seen & (ms[:, None] - ns[None, :] < window)
        return tl.where(seen, s, float("-inf")), t

    @triton.jit
    def _key_range(m0, lo, hi, window, BLOCK_M: tl.constexpr):
        """The keys a tile of queries from m0 sees: from the window's start (or the sequence's) to its last query."""
        first = lo
        if window > 0:
            first = tl.maximum(lo, m0 - window + 1)
        return first, tl.minimum(hi, m0 + BLOCK_M)

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, SINKS, TILES, scale, group, hq, hkv, d, window, CAP: tl.constexpr,
                    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        tile, h = tl.program_id(0), tl.program_id(1)
        m0, lo, hi = tl.load(TILES + tile * 3), tl.load(TILES + tile * 3 + 1), tl.load(TILES + tile * 3 + 2)
        ms, ds = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
        mm, dm = ms < hi, ds < d
        kh = h // group
        q = tl.load(Q + (ms[:, None] * hq + h) * d + ds[None, :], mask=mm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink: a first key of score `sink` and value 0
            m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h)
            l_i = l_i + 1.0
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first, last = _key_range(m0, lo, hi, window, BLOCK_M)
        for n0 in range(first, last, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            nm = (ns < last)[:, None] & dm[None, :]
            kt = tl.trans(tl.load(K + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0))
            s, _ = _scores(q, kt, ms, ns, lo, hi, scale, window, CAP)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(V + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        rows = mm[:, None] & dm[None, :]
        tl.store(O + (ms[:, None] * hq + h) * d + ds[None, :], out.to(O.dtype.element_ty), mask=rows)
        tl.store(LSE + ms * hq + h, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")), mask=mm)

    @triton.jit
    def _tile_grads(q, do, kt, vt, lse, delta, ms, ns, lo, hi, scale, window, CAP: tl.constexpr):
        """A tile's probabilities P [M, N] and the scores' gradient dS (through the cap), scaled."""
        s, t = _scores(q, kt, ms, ns, lo, hi, scale, window, CAP)
        p = tl.where(s == float("-inf"), 0.0, tl.exp(s - lse[:, None]))
        dp = tl.dot(do, vt).to(tl.float32)
        ds = p * (dp - delta[:, None])
        if CAP > 0:
            ds = ds * (1.0 - t * t)
        return p, ds * scale

    @triton.jit
    def _bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, TILES, scale, group, hq, hkv, d, window, CAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dK and dV of a tile of keys (the tiles list queries; keys are tiled the same way) and one KV head: over
        the group's query heads and the tiles of queries that see the keys."""
        tile, kh = tl.program_id(0), tl.program_id(1)
        n0, lo, hi = tl.load(TILES + tile * 3), tl.load(TILES + tile * 3 + 1), tl.load(TILES + tile * 3 + 2)
        ns, ds = n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
        nm = (ns < hi)[:, None] & (ds < d)[None, :]
        k = tl.load(K + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0)
        v = tl.load(V + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0)
        kt, vt = tl.trans(k), tl.trans(v)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        last = hi
        if window > 0:
            last = tl.minimum(hi, n0 + BLOCK_N - 1 + window)
        for g in range(0, group):
            h = kh * group + g
            for m0 in range(n0, last, BLOCK_M):
                ms = m0 + tl.arange(0, BLOCK_M)
                mm = (ms < hi)[:, None] & (ds < d)[None, :]
                q = tl.load(Q + (ms[:, None] * hq + h) * d + ds[None, :], mask=mm, other=0.0)
                do = tl.load(DO + (ms[:, None] * hq + h) * d + ds[None, :], mask=mm, other=0.0)
                lse = tl.load(LSE + ms * hq + h, mask=ms < hi, other=0.0)
                delta = tl.load(DELTA + ms * hq + h, mask=ms < hi, other=0.0)
                p, dsc = _tile_grads(q, do, kt, vt, lse, delta, ms, ns, lo, hi, scale, window, CAP)
                dv += tl.dot(tl.trans(p).to(do.dtype), do).to(tl.float32)
                dk += tl.dot(tl.trans(dsc).to(q.dtype), q).to(tl.float32)
        tl.store(DK + (ns[:, None] * hkv + kh) * d + ds[None, :], dk, mask=nm)
        tl.store(DV + (ns[:, None] * hkv + kh) * d + ds[None, :], dv, mask=nm)

    @triton.jit
    def _bwd_q_kernel(Q, K, V, DO, LSE, DELTA, DQ, TILES, scale, group, hq, hkv, d, window, CAP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dQ of a tile of queries and one query head: over the keys it sees, as the forward."""
        tile, h = tl.program_id(0), tl.program_id(1)
        m0, lo, hi = tl.load(TILES + tile * 3), tl.load(TILES + tile * 3 + 1), tl.load(TILES + tile * 3 + 2)
        ms, ds = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
        mm = (ms < hi)[:, None] & (ds < d)[None, :]
        kh = h // group
        q = tl.load(Q + (ms[:, None] * hq + h) * d + ds[None, :], mask=mm, other=0.0)
        do = tl.load(DO + (ms[:, None] * hq + h) * d + ds[None, :], mask=mm, other=0.0)
        lse = tl.load(LSE + ms * hq + h, mask=ms < hi, other=0.0)
        delta = tl.load(DELTA + ms * hq + h, mask=ms < hi, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first, last = _key_range(m0, lo, hi, window, BLOCK_M)
        for n0 in range(first, last, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            nm = (ns < last)[:, None] & (ds < d)[None, :]
            k = tl.load(K + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0)
            v = tl.load(V + (ns[:, None] * hkv + kh) * d + ds[None, :], mask=nm, other=0.0)
            _, dsc = _tile_grads(q, do, tl.trans(k), tl.trans(v), lse, delta, ms, ns, lo, hi, scale, window, CAP)
            dq += tl.dot(dsc.to(k.dtype), k).to(tl.float32)
        tl.store(DQ + (ms[:, None] * hq + h) * d + ds[None, :], dq, mask=mm)
