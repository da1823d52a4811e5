"""Paged decode attention for groups of sequences that share their first KV blocks: the G samples of one
prompt, which the engine forks from the prompt's blocks. Plain decode attention reads the prompt's keys
and values once per sample; here it is read once per group, as a cascade of two kernels:

1. `_prefix_kernel`: one program per (group, KV head, prefix split) puts all the group's query rows (up to
   MEMBERS sequences x the GQA group) into one tile and walks the shared tokens once, writing each row's
   partial output and log-sum-exp.
2. the plain decode kernel over each sequence's own tokens (those past `skip`, its group's shared length),
   which starts its online softmax from those partials, so no combine pass follows.

At 8 samples of a 128-token prompt and 512 new tokens that is about 29% fewer KV bytes, the bulk of a large
batch's decode step. The partials feed the second kernel directly because a separate combine pass costs
more launches than the bytes it saves (measurements in docs/engine.md).

Groups arrive as `order` (sequence indices, each group's members together, the groups that share
something first), `starts` [num_groups + 1] (where each sharing group begins in `order`), `shared`
[num_groups] (the tokens of their common blocks, cut at the shortest member's context) and `skip`
[num_sequences] (each sequence's group's `shared`, 0 for a sequence that shares nothing). Group slots past
the real groups have no members and return at once, so that a CUDA graph can be captured for more groups
than a step has."""
from __future__ import annotations

import numpy as np
import torch

from rlcu.kernels._paged_kv import attend_kv_tile, finish_split, kv_operands
from rlcu.kernels._triton import HAS_TRITON, next_pow2, num_sms, tl, triton
from rlcu.kernels.decode_attention import decode_attention_triton

MEMBERS = 8  # sequences per program; a larger group is served in chunks of this many


def prefix_groups(tables: np.ndarray, block_size: int, context_lens: np.ndarray, members: int = MEMBERS):
    """(order, starts, shared, skip) for a step's block tables [n, width] (0-padded) and context lengths:
    sequences whose first block is the same physical block share the blocks up to where their tables
    first differ (and never past a member's context). Groups larger than `members` are cut into chunks;
    sequences that share nothing come last in `order`, outside every group."""
    n = tables.shape[0]
    order = np.argsort(tables[:, 0], kind="stable").astype(np.int32)
    first = tables[order, 0]
    new = np.ones(n, dtype=bool)
    new[1:] = first[1:] != first[:-1]
    rank = np.arange(n) - np.maximum.accumulate(np.where(new, np.arange(n), 0))  # position within its group
    new |= rank % members == 0
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, n))
    leader = order[np.repeat(starts, sizes)]
    same = np.cumprod(tables[order] == tables[leader], axis=1)  # blocks equal to the leader's so far
    common = np.minimum.reduceat(same.sum(1), starts)
    within = np.minimum.reduceat(np.asarray(context_lens)[order], starts)
    shared = np.where(sizes > 1, np.minimum(common * block_size, within), 0).astype(np.int32)
    skip = np.empty(n, dtype=np.int32)
    skip[order] = np.repeat(shared, sizes)
    keep = shared > 0  # the prefix kernel's grid: only groups that share something
    member_of_kept = np.repeat(keep, sizes)
    order = np.concatenate([order[member_of_kept], order[~member_of_kept]])
    starts = np.append(0, np.cumsum(sizes[keep])).astype(np.int32)
    return order, starts, shared[keep], skip


def prefix_plan(num_groups: int, max_shared: int, num_kv_heads: int, block_n: int = 64,
                sms: int | None = None) -> tuple[int, int]:
    """(group slots, prefix splits) of the prefix kernel's grid: slots a power of two (a CUDA graph
    serves every step with as many groups or fewer); splits to spread a few groups' prompts over the
    GPU's SMs, never more than the shared tiles."""
    sms = num_sms() if sms is None else sms
    slots = 1 << max(0, (num_groups - 1).bit_length())
    tiles = max(1, -(-max_shared // block_n))
    return slots, max(1, min(8, tiles, sms * 4 // max(1, slots * num_kv_heads)))


if HAS_TRITON:
    @triton.jit
    def _prefix_kernel(Q, KC, VC, BT, ORDER, STARTS, SHARED, PO, PLSE, scale, stride_qs, stride_qh, stride_kb,
                       stride_kt, stride_kh, stride_bts, stride_ps, stride_ph, stride_pp, stride_ls, stride_lh,
                       num_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, E4M3_PAIRS: tl.constexpr, SOFTCAP: tl.constexpr):
        grp = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        start = tl.load(STARTS + grp)
        count = tl.load(STARTS + grp + 1) - start
        shared = tl.load(SHARED + grp, mask=count > 0, other=0)
        if shared > 0:  # groups of one and empty slots: their sequences read everything in the second kernel
            r = tl.arange(0, ROWS)
            member = r // GROUP_PAD
            head = kvh * GROUP + r % GROUP_PAD
            row_ok = (member < count) & (r % GROUP_PAD < GROUP)
            seq = tl.load(ORDER + start + member, mask=member < count, other=0)
            table_row = BT + tl.load(ORDER + start) * stride_bts  # the shared blocks are every member's
            d = tl.arange(0, HEAD_DIM)
            n = tl.arange(0, BLOCK_N)
            q = tl.load(Q + seq[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                        other=0.0)
            m = tl.full([ROWS], float("-inf"), tl.float32)
            l = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
            tiles = tl.cdiv(shared, BLOCK_N)
            per_split = tl.cdiv(tiles, num_splits)
            for t in range(split * per_split, tl.minimum(split * per_split + per_split, tiles)):
                token = t * BLOCK_N + n
                acc, m, l = attend_kv_tile(q, acc, m, l, KC, VC, table_row, token, token < shared, row_ok, scale,
                                           stride_kb, stride_kt, kvh * stride_kh, d, BLOCK_SIZE, PRECISION, E4M3_PAIRS,
                                           SOFTCAP)
            out, lse = finish_split(acc, m, l)
            tl.store(PO + seq[:, None] * stride_ps + head[:, None] * stride_ph + split * stride_pp + d[None, :], out,
                     mask=row_ok[:, None])
            tl.store(PLSE + seq * stride_ls + head * stride_lh + split, lse, mask=row_ok)


def shared_prefix_decode_triton(q, k_cache, v_cache, block_tables, context_lens, order, starts, shared, skip, scale,
                                num_splits: int | None = None, prefix_splits: int = 1, block_n: int = 64,
                                softcap: float | None = None):
    """As decode_attention over the same inputs, for sequences grouped by `prefix_groups` (on the device).
    `num_splits` divides each sequence's own tokens (None: as plain decode), `prefix_splits` the shared ones.
    The prefix kernel's grid has a slot per entry of `shared`. `softcap`: the scores' soft cap (`sdpa.py`)."""
    n_seq, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    group_pad = next_pow2(group)
    po = torch.empty(n_seq, hq, prefix_splits, d, dtype=torch.float32, device=q.device)
    plse = torch.empty(n_seq, hq, prefix_splits, dtype=torch.float32, device=q.device)
    kc, vc, pairs = kv_operands(k_cache, v_cache, q.dtype)
    _prefix_kernel[(shared.shape[0], hkv, prefix_splits)](
        q, kc, vc, block_tables, order, starts, shared, po, plse, scale, q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0), po.stride(0), po.stride(1),
        po.stride(2), plse.stride(0), plse.stride(1), prefix_splits, GROUP=group, GROUP_PAD=group_pad,
        ROWS=max(16, MEMBERS * group_pad), HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", E4M3_PAIRS=pairs, SOFTCAP=softcap or 0.0)
    return decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, block_n,
                                   prefix=(skip, po, plse), softcap=softcap)
