"""Decode attention for groups that share their first KV blocks, against the plain reference and float64:
groups of several sizes (one larger than a program's MEMBERS), a sequence sharing nothing, shared
prefixes that end inside a tile, GQA groups of 1, 2 and 3, the shared and own tokens each divided among
splits (more prefix splits than shared tiles, too), and empty group slots as a CUDA graph leaves them."""
import math

import numpy as np
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.decode_attention import decode_attention_reference
from rlcu.kernels.shared_prefix_decode import MEMBERS, prefix_groups, prefix_plan, shared_prefix_decode_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import float64_attention

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def forked_tables(groups, block_size, seed=0):
    """groups: [(members, shared_blocks, [own tokens of each member])]. Block tables in which each group's
    members name the same physical blocks for their shared prefix, then blocks of their own."""
    rng = np.random.default_rng(seed)
    tables, ctx = [], []
    free = list(rng.permutation(4 * sum(m * (s + 8) for m, s, _ in groups) + 8) + 1)  # block 0: padding only
    for members, shared, own in groups:
        prefix = [free.pop() for _ in range(shared)]
        for j in range(members):
            n_own = own[j]
            tables.append(prefix + [free.pop() for _ in range(-(-n_own // block_size))])
            ctx.append(shared * block_size + n_own)
    width = max(map(len, tables))
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    return table, ctx


def test_prefix_groups_finds_each_groups_common_blocks():
    table, ctx = forked_tables([(3, 2, [1, 5, 20]), (1, 0, [9]), (MEMBERS + 2, 1, [3] * (MEMBERS + 2))], 4)
    order, starts, shared, skip = prefix_groups(table, 4, np.array(ctx))
    assert sorted(order.tolist()) == list(range(len(ctx)))
    sizes = sorted(np.diff(starts).tolist())
    assert sizes == [2, 3, MEMBERS]  # the large group cut into chunks of MEMBERS; the lone sequence in none
    by_size = {int(b - a): int(s) for a, b, s in zip(starts[:-1], starts[1:], shared)}
    assert by_size == {3: 8, MEMBERS: 4, 2: 4}
    assert order[-1] == 3 and skip[3] == 0  # the sequence that shares nothing: last, and skips nothing
    for a, b, n in zip(starts[:-1], starts[1:], shared):  # members of one group share their first block
        assert len({int(table[i, 0]) for i in order[a:b]}) == 1
        assert (skip[order[a:b]] == n).all()  # and each member skips its group's shared tokens


@pytest.mark.parametrize("groups,max_shared", [(1, 5), (3, 128), (32, 128), (33, 4000)])
def test_prefix_plan_has_a_slot_per_group_and_no_split_without_a_tile(groups, max_shared):
    slots, splits = prefix_plan(groups, max_shared, num_kv_heads=8)
    assert slots >= groups and slots & (slots - 1) == 0
    assert 1 <= splits <= -(-max_shared // 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(16, 8), (9, 3), (4, 4)])
@pytest.mark.parametrize("block_size,block_n", [(16, 64), (12, 32)])
@pytest.mark.parametrize("num_splits,prefix_splits", [(1, 1), (3, 2), (1, 5)])
def test_shared_prefix_decode_matches_plain_attention(dtype, hq, hkv, block_size, block_n, num_splits, prefix_splits):
    check_against_plain_attention(dtype, hq, hkv, block_size, block_n, num_splits, prefix_splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capped_scores_in_shared_prefix_decode(dtype):
    """Gemma 2's soft-capped scores, in the shared tokens' kernel and the own tokens' alike."""
    check_against_plain_attention(dtype, 9, 3, 12, 32, 3, 2, softcap=2.5)


def check_against_plain_attention(dtype, hq, hkv, block_size, block_n, num_splits, prefix_splits, softcap=None):
    d = 64
    table, ctx = forked_tables([(5, 3, [1, 17, 40, 2, 64]), (1, 0, [30]), (MEMBERS + 3, 2, list(range(1, MEMBERS + 4))),
                                (2, 5, [16, 7])], block_size, seed=1)
    g = torch.Generator().manual_seed(2)
    blocks = int(table.max()) + 1
    k = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE)
    q = (torch.randn(len(ctx), hq, d, generator=g) * (4 if softcap else 1)).to(dtype).to(DEVICE)
    order, starts, shared, skip = prefix_groups(table, block_size, np.array(ctx))
    slots = len(ctx) + 4  # a CUDA graph's grid: more slots than groups, the rest without members
    starts = np.append(starts, [starts[-1]] * (slots + 1 - len(starts)))
    shared = np.append(shared, [0] * (slots - len(shared)))
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)
    t, c = dev(table), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(d)
    got = shared_prefix_decode_triton(q, k, v, t, c, dev(order), dev(starts), dev(shared), dev(skip), scale, num_splits,
                                      prefix_splits, block_n=block_n, softcap=softcap)
    ref = decode_attention_reference(q, k, v, t, c, scale, softcap=softcap)
    exact = float64_attention(q, k, v, t.cpu(), ctx, [(s, n - 1) for s, n in enumerate(ctx)], softcap=softcap)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)
