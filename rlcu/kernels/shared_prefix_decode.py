"""Paged decode attention for groups of sequences that share their first KV blocks: the G samples of one
prompt, which the engine forks from the prompt's blocks. Plain decode attention reads the prompt's keys
and values once per sample; here one program serves a whole group (up to MEMBERS sequences) for one KV
head and reads each shared tile once for all the group's query rows, then walks each member's own tokens
with the other members' rows masked. At 8 samples of a 128-token prompt and 512 new tokens that is about
29% fewer KV bytes, the bulk of a large batch's decode step.

Groups arrive as `order` (sequence indices, each group's members together), `starts` [num_groups + 1]
(where each group begins in `order`) and `shared` [num_groups] (the tokens of their common blocks, cut at
the shortest member's context). Slots past the real groups have no members and return at
once, so that a CUDA graph can be captured for the largest count. Each program's tiles (shared ones first,
then each member's own) are divided among `num_splits` programs and combined as in decode_attention."""
from __future__ import annotations

import numpy as np
import torch

from rlcu.kernels._paged_kv import load_kv_tile
from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton
from rlcu.kernels.decode_attention import combine_splits, split_buffers

MEMBERS = 8  # sequences per program; a larger group is served in chunks of this many


def prefix_groups(tables: np.ndarray, block_size: int, context_lens: np.ndarray, members: int = MEMBERS):
    """(order, starts, shared) for a step's block tables [n, width] (0-padded) and context lengths:
    sequences whose first block is the same physical block share the blocks up to where their tables
    first differ (and never past a member's context). Groups larger than `members` are cut into chunks;
    a sequence that shares nothing is a group of one."""
    n = tables.shape[0]
    order = np.argsort(tables[:, 0], kind="stable").astype(np.int32)
    first = tables[order, 0]
    new = np.ones(n, dtype=bool)
    new[1:] = first[1:] != first[:-1]
    rank = np.arange(n) - np.maximum.accumulate(np.where(new, np.arange(n), 0))  # position within its group
    new |= rank % members == 0
    starts = np.flatnonzero(new)
    leader = order[np.repeat(starts, np.diff(np.append(starts, n)))]
    same = np.cumprod(tables[order] == tables[leader], axis=1)  # blocks equal to the leader's so far
    common = np.minimum.reduceat(same.sum(1), starts)
    sizes = np.diff(np.append(starts, n))
    within = np.minimum.reduceat(np.asarray(context_lens)[order], starts)
    shared = np.where(sizes > 1, np.minimum(common * block_size, within), 0)
    return order, np.append(starts, n).astype(np.int32), shared.astype(np.int32)


if HAS_TRITON:
    @triton.jit
    def _attend_tile(q, acc, m, l, KC, VC, table_row, token, tmask, row_ok, scale, stride_kb, stride_kt, head_offset,
                     d, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
        k, v = load_kv_tile(KC, VC, table_row, token, tmask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(row_ok[:, None] & tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no -inf - -inf
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(m - shift)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        return acc, m_new, l * alpha + tl.sum(p, 1)

    @triton.jit
    def _shared_prefix_decode_kernel(Q, KC, VC, BT, CTX, ORDER, STARTS, SHARED, O, LSE, scale, stride_qs, stride_qh,
                                     stride_kb, stride_kt, stride_kh, stride_bts, stride_os, stride_oh, stride_osp,
                                     stride_ls, stride_lh, num_splits, GROUP: tl.constexpr,
                                     GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, MEMBERS_PAD: tl.constexpr,
                                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                     PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr):
        grp = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        start = tl.load(STARTS + grp)
        count = tl.load(STARTS + grp + 1) - start
        if count > 0:
            shared = tl.load(SHARED + grp)
            # the members as vectors, loaded at once: no chain of scalar loads before the first tile
            mi = tl.arange(0, MEMBERS_PAD)
            m_ok = mi < count
            seq_m = tl.load(ORDER + start + mi, mask=m_ok, other=0)
            ctx_m = tl.load(CTX + seq_m, mask=m_ok, other=0)
            own_m = tl.where(m_ok, tl.cdiv(ctx_m - shared, BLOCK_N), 0)  # each member's own tiles
            begin_m = tl.cumsum(own_m, 0) - own_m
            shared_tiles = tl.cdiv(shared, BLOCK_N)
            total = shared_tiles + tl.sum(own_m, 0)
            per_split = tl.cdiv(total, num_splits)
            first = split * per_split
            last = tl.minimum(first + per_split, total)
            r = tl.arange(0, ROWS)
            member = r // GROUP_PAD
            head = kvh * GROUP + r % GROUP_PAD
            row_ok = (member < count) & (r % GROUP_PAD < GROUP)
            seq = tl.load(ORDER + start + member, mask=member < count, other=0)
            d = tl.arange(0, HEAD_DIM)
            n = tl.arange(0, BLOCK_N)
            q = tl.load(Q + seq[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                        other=0.0)
            m = tl.full([ROWS], float("-inf"), tl.float32)
            l = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
            leader = tl.sum(tl.where(mi == 0, seq_m, 0), 0)
            for t in range(first, last):  # the shared tiles first (every row), then each member's own (its rows)
                in_prefix = t < shared_tiles
                u = t - shared_tiles
                j = tl.max(tl.where(m_ok & (begin_m <= u), mi, -1), 0)
                pick = mi == j
                owner = tl.where(in_prefix, leader, tl.sum(tl.where(pick, seq_m, 0), 0))
                limit = tl.where(in_prefix, shared, tl.sum(tl.where(pick, ctx_m, 0), 0))
                first_token = tl.where(in_prefix, t * BLOCK_N, shared + (u - tl.sum(tl.where(pick, begin_m, 0), 0)) * BLOCK_N)
                token = first_token + n
                acc, m, l = _attend_tile(q, acc, m, l, KC, VC, BT + owner * stride_bts, token, token < limit,
                                         row_ok & (in_prefix | (member == j)), scale, stride_kb, stride_kt,
                                         kvh * stride_kh, d, BLOCK_SIZE, PRECISION)
            empty = l == 0.0  # this split held none of the row's tiles
            out = acc / tl.where(empty, 1.0, l)[:, None]
            lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
            o_offs = seq[:, None] * stride_os + head[:, None] * stride_oh + split * stride_osp + d[None, :]
            tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
            if WRITE_LSE:
                tl.store(LSE + seq * stride_ls + head * stride_lh + split, lse, mask=row_ok)


def shared_prefix_num_splits(num_groups: int, num_kv_heads: int) -> int:
    """Enough programs to keep an H100/H200-sized GPU (132 SMs) streaming: each serves a whole group."""
    return max(1, min(16, 132 * 8 // max(1, num_groups * num_kv_heads)))


def shared_prefix_decode_triton(q, k_cache, v_cache, block_tables, context_lens, order, starts, shared, scale,
                                num_splits: int, block_n: int = 64):
    """As decode_attention over the same inputs, for sequences grouped by `prefix_groups` (on the device).
    The grid has a slot per entry of `shared`; slots without members do nothing."""
    hq, d = q.shape[1:]
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    group_pad = next_pow2(group)
    partial, lse = split_buffers(q, num_splits)
    _shared_prefix_decode_kernel[(shared.shape[0], hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, order, starts, shared, partial, lse, scale, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), num_splits,
        GROUP=group, GROUP_PAD=group_pad, ROWS=max(16, MEMBERS * group_pad), MEMBERS_PAD=next_pow2(MEMBERS),
        HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WRITE_LSE=num_splits > 1)
    return combine_splits(partial, lse, q.dtype)
