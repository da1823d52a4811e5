"""Attention of variable-length query chunks over the paged KV cache, causal, after any cached prefix:
query i of a sequence with context length L and q_len n sits at position L - n + i and sees keys
0 .. L - n + i. Prefill chunks and decode tokens of one engine step go through here together.

Triton: flash attention over the paged cache. One program per (tile of `block_m` queries of one
sequence, query head); the host lists the tiles once per step. Keys are gathered across cache blocks
in tiles of `block_n` and only up to the tile's last query position (causal skipping)."""
from __future__ import annotations

import torch

from rlcu.kernels._paged_kv import load_kv_tile, soft_cap
from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton
from rlcu.kernels.decode_attention import NO_WINDOW, triton_supports
from rlcu.kernels.sdpa import sdpa

BLOCK_M = 32  # queries per program
# A decode step's program in exact mode (`decode_rows`): its KV head's query heads as 16 rows. A row's softmax sum
# (`tl.sum` over a tile of 64 keys) is reduced in a tree that follows how Triton lays the program's warps over the
# tile, and that differs by the dot's kind: with 16-bit inputs (tensor cores) 16 rows on 4 warps keep the training
# forward's 32-query tiles' bits (on 4 warps) and 16 rows on 2 warps do not; with fp32 inputs (FMA dots) the reverse
# (benchmarks/exact_decode_rows.py: six head shapes, three dtypes, docs/benchmarks.md).
DECODE_ROWS, WARPS = 16, 4


def decode_warps(element_size: int) -> int:
    """Warps of a DECODE_ROWS program whose rows keep the training forward's reduction tree."""
    return WARPS if element_size == 2 else 2


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                              scale: float, window: int | None = None,
                              sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] (sequences concatenated); caches: [num_blocks, block_size, Hkv, D];
    cu_seqlens_q: [S + 1]; context_lens: [S] (keys per sequence, this step's included);
    block_tables: [S, max_blocks]; `window`: a query sees only the last `window` keys up to itself; `sinks` [Hq]:
    attention sinks; `softcap`: the scores' soft cap (both `sdpa.py`). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for s in range(len(ctx)):
        start, end, n_ctx = cu[s], cu[s + 1], ctx[s]
        if end == start:
            continue
        blocks = block_tables[s, :-(-n_ctx // bs)]
        k = k_cache[blocks].flatten(0, 1)[:n_ctx]
        v = v_cache[blocks].flatten(0, 1)[:n_ctx]
        n = end - start
        q_pos = torch.arange(n_ctx - n, n_ctx, device=q.device)[:, None]
        k_pos = torch.arange(n_ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= q_pos - k_pos < window
        o = sdpa(q[start:end].transpose(0, 1)[None], k.transpose(0, 1).to(q.dtype)[None],
                 v.transpose(0, 1).to(q.dtype)[None], mask, scale, sinks, softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out


if HAS_TRITON:
    @triton.jit
    def _prefill_kernel(Q, KC, VC, BT, CU, CTX, TILE_SEQ, TILE_START, O, SINKS, scale, window, stride_qt, stride_qh,
                        stride_kb, stride_kt, stride_kh, stride_bts, stride_ot, stride_oh, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
                        SOFTCAP: tl.constexpr, HEAD_ROWS: tl.constexpr):
        tile = tl.program_id(0)
        s = tl.load(TILE_SEQ + tile)
        first_row = tl.load(TILE_START + tile)
        start = tl.load(CU + s)
        n_q = tl.load(CU + s + 1) - start
        ctx = tl.load(CTX + s)
        r = tl.arange(0, BLOCK_M)
        if HEAD_ROWS:  # one query (a decode step's), its rows the query heads that share this program's kv head
            kvh = tl.program_id(1)
            heads = kvh * GROUP + r
            rows = first_row + r * 0
            rmask = (r < GROUP) & (rows < n_q)
        else:  # the rows are up to BLOCK_M queries of one query head
            heads = tl.program_id(1) + r * 0
            kvh = tl.program_id(1) // GROUP
            rows = first_row + r
            rmask = rows < n_q
        q_pos = ctx - n_q + rows
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if HAS_SINKS:  # the sink as the softmax's first entry: a virtual key with a zero value
            m = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(SINKS + heads, mask=rmask, other=0.0).to(tl.float32)
            l = tl.full([BLOCK_M], 1.0, tl.float32)
        n = tl.arange(0, BLOCK_N)
        key_end = tl.minimum(ctx - n_q + first_row + BLOCK_M, ctx)  # the tile's last query sees no further
        # the tile's first query sees no key before its window; tiles stay aligned to absolute positions, and a
        # tile wholly outside a row's window leaves that row's state as it was, so the sums do not depend on it
        key_start = (tl.maximum(ctx - n_q + first_row - window + 1, 0) // BLOCK_N) * BLOCK_N
        for k0 in range(key_start, key_end, BLOCK_N):
            token = k0 + n
            kmask = token < key_end
            # E4M3_PAIRS off: an FP8 cache is read as FP8 and widened to q's dtype below
            k, v = load_kv_tile(KC, VC, BT + s * stride_bts, token, kmask, stride_kb, stride_kt, kvh * stride_kh, d,
                                BLOCK_SIZE, 0)
            k, v = k.to(q.dtype), v.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP > 0:
                scores = soft_cap(scores, SOFTCAP)
            seen = (token[None, :] <= q_pos[:, None]) & (q_pos[:, None] - token[None, :] < window)
            scores = tl.where(kmask[None, :] & seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(O + (start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=rmask[:, None])


def query_tiles(cu_seqlens_q: list[int], block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query row) of every tile of `block_m` queries: what the kernel's grid walks."""
    seqs, starts = [], []
    for s in range(len(cu_seqlens_q) - 1):
        for r in range(0, cu_seqlens_q[s + 1] - cu_seqlens_q[s], block_m):
            seqs.append(s)
            starts.append(r)
    return (torch.tensor(seqs, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, tiles=None,
                           block_m: int | None = None, block_n: int = 64, window: int | None = None,
                           sinks: torch.Tensor | None = None, softcap: float | None = None,
                           decode_rows: bool = False, num_warps: int | None = None):
    """`tiles`: `query_tiles(cu_seqlens_q, block_m)`, when the caller has it already (it costs a sync); `sinks`
    [Hq]: attention sinks; `softcap`: the scores' soft cap (both `sdpa.py`). `decode_rows`: the caller's word
    that every sequence has one query (a decode step): a program then takes a kv head and the query heads that
    share it as its rows, reading each key once instead of once a query head. A row's sums are the same
    either way (the same tiles of keys from position 0, the same reduction tree: DECODE_ROWS), so exact mode's
    decode keeps the training forward's bits. `block_m`, `num_warps`: a program's rows and warps (None: BLOCK_M
    queries on WARPS, or a decode step's DECODE_ROWS heads on `decode_warps`)."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert triton_supports(d, bs), f"head_dim {d}: a power of two >= 16 only"
    head_rows = decode_rows and hq // hkv <= (block_m or BLOCK_M)
    if block_m is None and head_rows and hq // hkv <= DECODE_ROWS:
        block_m, num_warps = DECODE_ROWS, num_warps or decode_warps(q.element_size())
    block_m = block_m or BLOCK_M
    if tiles is None:
        tiles = query_tiles(cu_seqlens_q.tolist(), block_m, q.device)
    out = torch.empty_like(q)
    if len(tiles[0]):
        _prefill_kernel[(len(tiles[0]), hkv if head_rows else hq)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, tiles[0], tiles[1], out,
            out if sinks is None else sinks, scale, window or NO_WINDOW,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), GROUP=hq // hkv, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=block_m,
            BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_SINKS=sinks is not None,
            SOFTCAP=softcap or 0.0, HEAD_ROWS=head_rows, num_warps=num_warps or WARPS)
    return out


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, tiles=None,
                    window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
                    decode_rows: bool = False):
    if use_triton(q) and triton_supports(q.shape[-1], k_cache.shape[1]):
        return paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, tiles,
                                      window=window, sinks=sinks, softcap=softcap, decode_rows=decode_rows)
    return paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window,
                                     sinks, softcap)
