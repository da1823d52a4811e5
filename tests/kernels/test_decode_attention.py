"""Paged decode attention (split-KV, GQA) against float64 and the PyTorch reference, on odd shapes."""
import math

import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.decode_attention import (
    DECODE_BLOCK_N,
    DECODE_BLOCK_N_FP8,
    combine_splits,
    combine_splits_reference,
    decode_attention_reference,
    decode_attention_triton,
    default_block_n,
)
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import float64_attention, paged_cache

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("context_lens,block_size,block_n", [([1, 17, 40, 100], 16, 64), ([1], 16, 16),
                                                             ([33, 300], 32, 32), ([5, 70, 129], 12, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention(dtype, hq, hkv, d, context_lens, block_size, block_n, num_splits):
    k, v, table = paged_cache(context_lens, hkv, d, block_size, dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(d)
    got = decode_attention_triton(q, k, v, table, ctx, scale, num_splits=num_splits, block_n=block_n)
    ref = decode_attention_reference(q, k, v, table, ctx, scale)
    exact = float64_attention(q, k, v, table, context_lens, [(s, n - 1) for s, n in enumerate(context_lens)])
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 3, 5, 16])
def test_combine_splits_against_float64(dtype, splits):
    """The splits' partial outputs weighed by their log-sum-exps, with empty splits (lse -inf, output 0) among
    them; a row whose splits are all empty (a CUDA graph's padding) gives 0."""
    g = torch.Generator().manual_seed(splits)
    partial = torch.randn(3, 5, splits, 64, generator=g)
    lse = 4 * torch.randn(3, 5, splits, generator=g)
    empty = torch.rand(3, 5, splits, generator=g) < 0.3
    empty[..., 0] = False
    empty[2, 4] = True
    lse[empty], partial[empty] = float("-inf"), 0.0
    got = combine_splits(partial.to(DEVICE), lse.to(DEVICE), dtype).double().cpu()
    w = torch.softmax(lse.double(), -1).nan_to_num(0.0)
    exact = (partial.double() * w[..., None]).sum(2)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got, exact, atol=atol, rtol=rtol), (got - exact).abs().max()
    assert got[2, 4].abs().max() == 0
    ref = combine_splits_reference(partial, lse, dtype).double()
    assert torch.allclose(ref[:2], exact[:2], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_soft_capped_scores_in_decode(dtype, window, num_splits):
    """Gemma 2's scores, cap * tanh(score / cap), at a cap that bends most of them (queries scaled up, so that
    scores span both tanh's flat tails and its near-linear middle)."""
    context_lens = [1, 17, 40, 130]
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=17)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = (4 * torch.randn(len(context_lens), 9, 64, generator=torch.Generator().manual_seed(18))).to(dtype).to(DEVICE)
    got = decode_attention_triton(q, k, v, table, ctx, 0.125, num_splits=num_splits, block_n=32, window=window,
                                  softcap=2.5)
    ref = decode_attention_reference(q, k, v, table, ctx, 0.125, window=window, softcap=2.5)
    positions = [(s, n - 1) for s, n in enumerate(context_lens)]
    exact = float64_attention(q, k, v, table, context_lens, positions, window, softcap=2.5)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)
    plain = float64_attention(q, k, v, table, context_lens, positions, window)
    assert (plain - exact).abs().max() > 0.1  # the cap changes the output


def test_garbage_past_the_context_never_leaks():
    """Pool slots past a sequence's context may hold NaN (uninitialised memory): no output may change."""
    k, v, table = paged_cache([5, 20], 3, 64, 16, torch.float32)
    ctx = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 9, 64, device=DEVICE)
    clean = decode_attention_reference(q, k, v, table, ctx, 0.125)
    k.view(-1, 3, 64)[table[0, 0].long() * 16 + 5:table[0, 0].long() * 16 + 16] = float("nan")
    v[table[1, 1].long(), 4:] = float("nan")
    both = (decode_attention_reference(q, k, v, table, ctx, 0.125), decode_attention_triton(q, k, v, table, ctx, 0.125))
    for out in both:
        assert torch.allclose(out, clean, atol=2e-5)


def test_fp8_caches_take_long_tiles_only_when_many_programs_share_an_sm():
    assert default_block_n(128, 8, fp8=True, sms=132) == DECODE_BLOCK_N_FP8  # 7.8 programs an SM
    assert default_block_n(64, 8, fp8=True, sms=132) == DECODE_BLOCK_N  # 3.9: each program's chain of tiles is its time
    assert default_block_n(512, 8, fp8=False, sms=132) == DECODE_BLOCK_N


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 37, 64, 1000])  # one key, inside a tile, across tiles, a tile, wider
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_decode(dtype, window, num_splits):
    context_lens = [1, 17, 40, 130]
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=7)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), 9, 64, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    got = decode_attention_triton(q, k, v, table, ctx, 0.125, num_splits=num_splits, block_n=32, window=window)
    ref = decode_attention_reference(q, k, v, table, ctx, 0.125, window=window)
    exact = float64_attention(q, k, v, table, context_lens, [(s, n - 1) for s, n in enumerate(context_lens)], window)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5, 37])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_sinks_in_decode(dtype, window, num_splits):
    """gpt-oss's sinks (a logit per head, its share dropped), counted once over the splits, with and without a
    window; sinks of either sign and one far above every score (the head then attends to almost nothing)."""
    context_lens = [1, 17, 40, 130]
    k, v, table = paged_cache(context_lens, 3, 64, 12, dtype, seed=13)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), 9, 64, generator=torch.Generator().manual_seed(14)).to(dtype).to(DEVICE)
    sinks = torch.tensor([-2.0, 0.0, 1.5, 3.0, -0.5, 0.7, 30.0, -30.0, 2.2], device=DEVICE)
    got = decode_attention_triton(q, k, v, table, ctx, 0.125, num_splits=num_splits, block_n=32, window=window,
                                  sinks=sinks)
    ref = decode_attention_reference(q, k, v, table, ctx, 0.125, window=window, sinks=sinks)
    exact = float64_attention(q, k, v, table, context_lens, [(s, n - 1) for s, n in enumerate(context_lens)], window,
                              sinks)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)
    plain = float64_attention(q, k, v, table, context_lens, [(s, n - 1) for s, n in enumerate(context_lens)], window)
    assert (plain - exact).abs().max() > 0.1  # the sinks change the output
