"""Paged decode attention: one new query token per sequence against its whole paged KV context.

Triton: one program per (sequence, KV head, split). It serves every query head of its GQA group at
once (any group size, padded to a power of two), walks its share of the sequence's tokens in tiles of
`block_n` (gathered across cache blocks) with an online softmax, and writes a partial output with its
log-sum-exp; the splits are then combined. Split-KV keeps all SMs busy when there are few sequences
with long contexts. Each sequence divides its own tokens among the splits, so the launch depends on no
host-side length and can be captured in a CUDA graph.
Shared-prefix decode (shared_prefix_decode.py) runs this kernel after its own: each sequence then reads only
the tokens past its group's shared prompt, starting from the partial softmax of those."""
from __future__ import annotations

import torch

from rlcu.kernels._paged_kv import attend_kv_tile, finish_split, kv_operands
from rlcu.kernels._triton import HAS_TRITON, next_pow2, num_sms, tl, triton, use_triton
from rlcu.kernels.sdpa import sdpa


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int | None = None, sinks: torch.Tensor | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """q: [S, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [S, max_blocks];
    context_lens: [S]; `window`: only the last `window` keys (None: all); `sinks` [Hq]: attention sinks;
    `softcap`: the scores' soft cap (both `sdpa.py`). Returns [S, Hq, D]. All sequences at once: their blocks
    gathered and padded."""
    tables = block_tables.long()
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [S, Hkv, max_blocks * block_size, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = pos < context_lens[:, None]
    if window is not None:
        mask &= pos >= context_lens[:, None] - window
    # slots past the context may hold anything: the engine's pool starts as zeros, but a block returned to it
    # keeps what an earlier sequence wrote, and a caller's pool may hold NaN; a mask alone would still let
    # NaN * 0 through, so zero them
    k = k.masked_fill(~mask[:, None, :, None], 0)
    v = v.masked_fill(~mask[:, None, :, None], 0)
    return sdpa(q[:, :, None], k, v, mask[:, None, None], scale, sinks, softcap)[:, :, 0]


if HAS_TRITON:
    @triton.jit
    def _decode_kernel(Q, KC, VC, BT, CTX, O, LSE, SKIP, PO, PLSE, SINKS, scale, window, stride_qs, stride_qh,
                       stride_kb, stride_kt, stride_kh, stride_bts, stride_os, stride_oh, stride_osp, stride_ls,
                       stride_lh, stride_ps, stride_ph, stride_pp, stride_pls, stride_plh, num_splits,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr,
                       PREFIX_SPLITS: tl.constexpr, E4M3_PAIRS: tl.constexpr, HAS_SINKS: tl.constexpr,
                       SOFTCAP: tl.constexpr):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(CTX + s)
        skip = 0
        if PREFIX_SPLITS > 0:  # tokens before `skip` were attended by shared_prefix_decode's first kernel
            skip = tl.load(SKIP + s)
        # a sliding window's first key; tiles stay aligned to absolute positions, so the sums do not depend on it
        lo = tl.maximum(ctx - window, 0)
        skip = tl.maximum(skip, (lo // BLOCK_N) * BLOCK_N)
        num_tiles = tl.cdiv(ctx - skip, BLOCK_N)
        per_split = tl.cdiv(num_tiles, num_splits)
        first = split * per_split
        last = tl.minimum(first + per_split, num_tiles)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q = tl.load(Q + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        if HAS_SINKS:  # the sink as the softmax's first entry, in split 0 only: a virtual key with a zero value
            sink = tl.load(SINKS + heads, mask=gmask, other=float("-inf")).to(tl.float32)
            m = tl.where(split == 0, sink, m)
            l = tl.where((split == 0) & gmask, 1.0, l)
        if PREFIX_SPLITS > 0:
            if (split == 0) & (skip > 0):  # the softmax state of the shared tokens: m = their lse, l = 1, acc = out
                for i in tl.static_range(PREFIX_SPLITS):
                    lse_p = tl.load(PLSE + s * stride_pls + heads * stride_plh + i, mask=gmask, other=float("-inf"))
                    o_p = tl.load(PO + s * stride_ps + heads[:, None] * stride_ph + i * stride_pp + d[None, :],
                                  mask=gmask[:, None], other=0.0)
                    m_new = tl.maximum(m, lse_p)
                    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m - shift)
                    w = tl.exp(lse_p - shift)
                    acc = acc * alpha[:, None] + o_p * w[:, None]
                    l = l * alpha + w
                    m = m_new
        for tile in range(first, last):
            token = skip + tile * BLOCK_N + n
            acc, m, l = attend_kv_tile(q, acc, m, l, KC, VC, BT + s * stride_bts, token, (token < ctx) & (token >= lo),
                                       gmask, scale,
                                       stride_kb, stride_kt, kvh * stride_kh, d, BLOCK_SIZE, PRECISION, E4M3_PAIRS,
                                       SOFTCAP)
        out, lse = finish_split(acc, m, l)
        o_offs = s * stride_os + heads[:, None] * stride_oh + split * stride_osp + d[None, :]
        tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=gmask[:, None])
        if WRITE_LSE:
            tl.store(LSE + s * stride_ls + heads * stride_lh + split, lse, mask=gmask)


DECODE_BLOCK_N = 64  # tokens per tile
# an FP8 tile of 64 tokens is half the bytes in flight of a bf16 one: 128 keeps the loads as large, which pays
# when there are many programs an SM; with few, each program's chain of tiles is its latency, and shorter tiles
# finish sooner (on the H200: benchmarks/decode_tiles.py, docs/benchmarks.md "61c3f7c")
DECODE_BLOCK_N_FP8 = 128
FP8_LONG_TILES_FROM = 6  # programs an SM: 128 sequences x 8 KV heads on 132 SMs, not 64


def default_block_n(n_seq: int, num_kv_heads: int, fp8: bool, sms: int | None = None) -> int:
    sms = num_sms() if sms is None else sms
    return DECODE_BLOCK_N_FP8 if fp8 and n_seq * num_kv_heads >= FP8_LONG_TILES_FROM * sms else DECODE_BLOCK_N


def default_num_splits(n_seq: int, num_kv_heads: int, max_tokens: int, block_n: int = 64,
                       sms: int | None = None) -> int:
    """Enough programs to fill the GPU (4 per SM) when sequences are few and long."""
    sms = num_sms() if sms is None else sms
    return max(1, min(-(-max_tokens // block_n), 16, sms * 4 // max(1, n_seq * num_kv_heads)))


NO_WINDOW = 1 << 30  # the kernels' window when there is none: wider than any context


def decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int | None = None,
                            block_n: int | None = None, prefix=None, num_warps: int = 4, num_stages: int = 3,
                            window: int | None = None, sinks: torch.Tensor | None = None,
                            softcap: float | None = None):
    """`prefix`: (skip [S], out [S, Hq, P, D], lse [S, Hq, P]) from shared_prefix_decode: each sequence's first
    `skip` tokens are already attended, in P partials, and only the rest is read here. `sinks` [Hq]: attention
    sinks; `softcap`: the scores' soft cap (both `sdpa.py`). `num_warps`, `num_stages`: Triton's launch options
    (its defaults), for benchmarks/decode_kv_dtype.py's sweep."""
    n_seq, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert triton_supports(d, bs), f"head_dim {d}: a power of two >= 16 only"
    assert prefix is None or (window is None and sinks is None), "shared-prefix decode takes no window or sinks"
    block_n = block_n or default_block_n(n_seq, hkv, k_cache.element_size() == 1)
    if num_splits is None:
        num_splits = default_num_splits(n_seq, hkv, block_tables.shape[1] * bs, block_n)
    group = hq // hkv
    partial, lse = split_buffers(q, num_splits)
    skip, po, plse = prefix if prefix is not None else (context_lens, lse[:, :, None], lse)  # unread without a prefix
    kc, vc, pairs = kv_operands(k_cache, v_cache, q.dtype)
    _decode_kernel[(n_seq, hkv, num_splits)](
        q, kc, vc, block_tables, context_lens, partial, lse, skip, po, plse, lse if sinks is None else sinks, scale,
        window or NO_WINDOW,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0), partial.stride(0),
        partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), po.stride(0), po.stride(1), po.stride(2),
        plse.stride(0), plse.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (tl.dot defaults to tf32)
        WRITE_LSE=num_splits > 1, PREFIX_SPLITS=po.shape[2] if prefix is not None else 0, E4M3_PAIRS=pairs,
        HAS_SINKS=sinks is not None, SOFTCAP=softcap or 0.0, num_warps=num_warps, num_stages=num_stages)
    return combine_splits(partial, lse, q.dtype)


def split_buffers(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's output [S, Hq, splits, D] and log-sum-exp [S, Hq, splits]. One split: the kernel
    writes the final output in q's dtype; several: fp32 partials for `combine_splits`."""
    n_seq, hq, d = q.shape
    partial = torch.empty(n_seq, hq, num_splits, d, dtype=torch.float32 if num_splits > 1 else q.dtype, device=q.device)
    return partial, torch.empty(n_seq, hq, num_splits, dtype=torch.float32, device=q.device)


def combine_splits_reference(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    weights = torch.softmax(lse, dim=-1)  # exp(lse_i - logsumexp(lse)): each split's share of the softmax mass
    return (partial * weights[..., None]).sum(2).to(dtype)


if HAS_TRITON:
    @triton.jit
    def _combine_splits_kernel(P, LSE, O, stride_ps, stride_ph, stride_pp, stride_ls, stride_lh, stride_os,
                               stride_oh, num_splits, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Program (s, h): the splits' outputs of one query head weighed by their share of the softmax mass. A row
        whose splits all saw no token (a CUDA graph's padding) gives 0."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        valid = i < num_splits
        lse = tl.load(LSE + s * stride_ls + h * stride_lh + i, mask=valid, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
        p = tl.load(P + s * stride_ps + h * stride_ph + i[:, None] * stride_pp + d[None, :], mask=valid[:, None],
                    other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(p * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(O + s * stride_os + h * stride_oh + d, out.to(O.dtype.element_ty))


def combine_splits(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial [S, Hq, splits, D] fp32, lse [S, Hq, splits] -> [S, Hq, D] in `dtype`. Triton: one launch, where
    the reference's softmax, product, sum and cast are four a layer (at 64 sequences x 4 KV heads, two splits
    each, they took longer than half the decode kernel's own time)."""
    if partial.shape[2] == 1:
        return partial[:, :, 0]
    n_seq, hq, splits, d = partial.shape
    out = torch.empty(n_seq, hq, d, dtype=dtype, device=partial.device)
    _combine_splits_kernel[(n_seq, hq)](partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2),
                                        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), splits,
                                        SPLITS_PAD=next_pow2(splits), HEAD_DIM=d)
    return out


def triton_supports(head_dim: int, block_size: int) -> bool:
    """tl.dot needs power-of-two tiles of at least 16 (a tile gathers whole tokens, so any block size works)."""
    return head_dim == next_pow2(head_dim) >= 16 and block_size >= 1


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int | None = None,
                     window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None):
    if use_triton(q) and triton_supports(q.shape[-1], k_cache.shape[1]):
        return decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                                       window=window, sinks=sinks, softcap=softcap)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, window, sinks, softcap)
