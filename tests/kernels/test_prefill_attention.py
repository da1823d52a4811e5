"""Paged prefill attention (chunks after a cached prefix, GQA) against float64 and the PyTorch reference."""
import math

import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.prefill_attention import paged_attention_reference, paged_attention_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import float64_attention, paged_cache

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reference_after_a_cached_prefix(dtype):
    context_lens, q_lens = [20, 5, 37], [7, 5, 1]  # a chunk after 13 cached tokens, a full prompt, a decode
    k, v, table = paged_cache(context_lens, 3, 64, 16, dtype)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    cu = torch.tensor([0, 7, 12, 13], device=DEVICE)
    got = paged_attention_reference(q, k, v, cu, torch.tensor(context_lens, device=DEVICE), table, 1 / 8)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k, v, table, context_lens, positions)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 8, 128), (2, 2, 16)])
@pytest.mark.parametrize("context_lens,q_lens,block_size", [
    ([20, 5, 37], [7, 5, 1], 16),  # a chunk after 13 cached tokens, a whole prompt, a decode
    ([70, 1, 133], [70, 1, 45], 12),  # tiles of several query blocks, a one-token prompt, blocks of 12
    ([64], [33], 16),
])
def test_prefill_attention_triton(dtype, hq, hkv, d, context_lens, q_lens, block_size):
    k, v, table = paged_cache(context_lens, hkv, d, block_size, dtype, seed=4)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(d)
    got = paged_attention_triton(q, k, v, cu, ctx, table, scale)
    ref = paged_attention_reference(q, k, v, cu, ctx, table, scale)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k, v, table, context_lens, positions)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 33, 64])
def test_sliding_window_prefill(dtype, window):
    context_lens, q_lens = [70, 5, 133], [70, 5, 45]  # whole prompts, and a chunk after 88 cached tokens
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=9)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, window=window)
    ref = paged_attention_reference(q, k, v, cu, ctx, table, 0.125, window=window)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k, v, table, context_lens, positions, window)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 33])
def test_attention_sinks_in_prefill(dtype, window):
    """gpt-oss's sinks in prefill chunks after a cached prefix, with and without a window."""
    context_lens, q_lens = [70, 5, 133], [70, 5, 45]
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=15)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(16)).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    sinks = torch.tensor([-2.0, 0.0, 1.5, 3.0, -0.5, 0.7, 30.0, -30.0, 2.2], device=DEVICE)
    got = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, window=window, sinks=sinks)
    ref = paged_attention_reference(q, k, v, cu, ctx, table, 0.125, window=window, sinks=sinks)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k, v, table, context_lens, positions, window, sinks)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 33])
def test_soft_capped_scores_in_prefill(dtype, window):
    """Gemma 2's soft-capped scores in prefill chunks after a cached prefix, with and without a window."""
    context_lens, q_lens = [70, 5, 133], [70, 5, 45]
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=19)
    q = (4 * torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(20))).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, window=window, softcap=2.5)
    ref = paged_attention_reference(q, k, v, cu, ctx, table, 0.125, window=window, softcap=2.5)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k, v, table, context_lens, positions, window, softcap=2.5)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)
    assert (float64_attention(q, k, v, table, context_lens, positions, window) - exact).abs().max() > 0.1


def test_a_window_keeps_the_sums_of_a_decode_query_and_a_prefill_tile_equal():
    """exact_logprobs decodes through the prefill kernel one query at a time and trains on tiles of 32 queries;
    with a window, a row's first tile must not depend on the other rows of its query tile."""
    n, window = 100, 37
    k, v, table = paged_cache([n], 3, 64, 16, torch.float32, seed=11)
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    whole = paged_attention_triton(q, k, v, torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                   torch.tensor([n], dtype=torch.int32, device=DEVICE), table, 0.125, window=window)
    for pos in (40, 77, 99):
        one = paged_attention_triton(q[pos:pos + 1], k, v, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                                     torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE), table, 0.125,
                                     window=window)
        if DEVICE == "cpu":
            # the interpreter's tl.dot is numpy's BLAS, whose one-row and many-row kernels may round a last bit
            # apart on some CPUs (OpenBLAS picks them by CPU); a tile-dependent window would be off by far more
            torch.testing.assert_close(one[0], whole[pos], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(one[0], whole[pos])


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,window,sinks,softcap", [(9, 3, None, False, None), (16, 8, 37, False, None),
                                                          (8, 1, None, True, 2.5), (4, 2, 20, True, None)])
def test_decode_rows_of_a_kv_heads_query_heads_keep_each_rows_bits(dtype, hq, hkv, window, sinks, softcap):
    """A decode step through the prefill kernel with a program per kv head (its query heads as the rows)
    gives each query head the bits of a program per query head: exact mode decodes the first way and
    trains the second. The check has teeth: key tiles of 32 instead of 64 give other bits (in fp32, where
    half-precision outputs may round them back alike)."""
    context_lens = [1, 17, 64, 100, 130]
    k, v, table = paged_cache(context_lens, hkv, 64, 16, dtype, seed=13)
    q = torch.randn(len(context_lens), hq, 64, generator=torch.Generator().manual_seed(14)).to(dtype).to(DEVICE)
    cu = torch.arange(len(context_lens) + 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(15)).to(DEVICE) if sinks else None
    kwargs = dict(window=window, sinks=sink, softcap=softcap)
    per_head = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, **kwargs)
    per_kv_head = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, decode_rows=True, **kwargs)
    assert torch.equal(per_kv_head, per_head)
    atol, rtol = TOLERANCE[dtype]
    want = paged_attention_reference(q, k, v, cu, ctx, table, 0.125, window, sink, softcap)
    assert torch.allclose(per_kv_head.double(), want.double(), atol=atol, rtol=rtol)
    if dtype == torch.float32:
        other_tiles = paged_attention_triton(q, k, v, cu, ctx, table, 0.125, block_n=32, **kwargs)
        assert not torch.equal(other_tiles, per_head)
