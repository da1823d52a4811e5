"""Triton kernels against their PyTorch reference and float64, on odd shapes, run on the CPU under
TRITON_INTERPRET=1 (fp32/fp16 there) and on the GPU as they are."""
import math

import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.decode_attention import decode_attention_reference, decode_attention_triton
from rlcu.kernels.prefill_attention import paged_attention_reference, paged_attention_triton

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# dtype -> (atol, rtol) against float64
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def paged_cache(context_lens, hkv, d, block_size, dtype, seed=0):
    """A shuffled block pool holding random K/V for each sequence, and its block table."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    total = sum(need) + 3  # spare blocks the tables never name
    order = torch.randperm(total, generator=g)
    k = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(context_lens), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = order[used:used + n]
        used += n
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


def float64_attention(q, k, v, table, ctx, q_positions):
    """Straight from the definition, one query at a time, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for i, (s, pos) in enumerate(q_positions):
        keys = k[table[s].long()].flatten(0, 1)[:ctx[s]].double().cpu()
        vals = v[table[s].long()].flatten(0, 1)[:ctx[s]].double().cpu()
        for h in range(q.shape[1]):
            scores = keys[:pos + 1, h // group] @ q[i, h].double().cpu() / math.sqrt(q.shape[-1])
            out[i, h] = torch.softmax(scores, 0) @ vals[:pos + 1, h // group]
    return out


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


def test_garbage_past_the_context_never_leaks():
    """Pool slots past a sequence's context may hold NaN (uninitialised memory): no output may change."""
    k, v, table = paged_cache([5, 20], 3, 64, 16, torch.float32)
    ctx = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 9, 64, device=DEVICE)
    clean = decode_attention_reference(q, k, v, table, ctx, 0.125)
    k.view(-1, 3, 64)[table[0, 0].long() * 16 + 5:table[0, 0].long() * 16 + 16] = float("nan")
    v[table[1, 1].long(), 4:] = float("nan")
    for out in (decode_attention_reference(q, k, v, table, ctx, 0.125), decode_attention_triton(q, k, v, table, ctx, 0.125)):
        assert torch.allclose(out, clean, atol=2e-5)
