"""The KV-cache write and the three paged attention kernels on an FP8 (e4m3) cache: writes rounded and
saturated as torch rounds, bit for bit; attention over the cache against float64 over the dequantized
values (the FP8 rounding itself is the cache's, so what the kernels add must stay within the query's dtype)."""
import math

import numpy as np
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.decode_attention import decode_attention_reference, decode_attention_triton
from rlcu.kernels.kv_cache import FP8, FP8_MAX, store_kv_reference, to_cache
from rlcu.kernels.prefill_attention import paged_attention_reference, paged_attention_triton
from rlcu.kernels.rope_store_kv import rope_store_kv_reference, rope_store_kv_triton
from rlcu.kernels.shared_prefix_decode import prefix_groups, shared_prefix_decode_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE, float64_attention, paged_cache

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def fp8_cache(context_lens, hkv, d, block_size, seed=0):
    k, v, table = paged_cache(context_lens, hkv, d, block_size, torch.float32, seed=seed)
    return to_cache(k, FP8), to_cache(v, FP8), table


def test_to_cache_rounds_to_nearest_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.07, -3.3, 300.0, 449.0, 1e6, -1e6, 2.0 ** -9])
    got = to_cache(x, FP8).float()
    # e4m3: 3 mantissa bits (1.0625 is a tie between 1.0 and 1.125: to even), max 448, smallest subnormal 2^-9
    want = torch.tensor([0.0, 1.0, 1.0, 1.125, -3.25, 288.0, 448.0, FP8_MAX, -FP8_MAX, 2.0 ** -9])
    assert torch.equal(got, want)
    assert not torch.isnan(got).any()


if _triton.HAS_TRITON:
    from rlcu.kernels._triton import tl, triton
    from rlcu.kernels.kv_cache import round_e4m3

    @triton.jit
    def _round_kernel(X, Y, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(Y + i, round_e4m3(tl.load(X + i)).to(Y.dtype.element_ty))


def test_triton_rounding_equals_torchs_cast():
    """Random values over every binade e4m3 has (subnormals included), every e4m3 value, every tie between two
    neighbours, zeros of both signs and values past the range: the same bits as torch's cast after the clamp."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].sort().values
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(2048, generator=g) * s for s in (1e-4, 1e-3, 3e-3, 1e-2, 0.1, 1, 10, 100, 1000)]
                  + [grid, ties, torch.tensor([0.0, -0.0, 2.0 ** -10, -(2.0 ** -10), 1e-30, 449.0, 463.9, 464.0, 1e9])])
    x = torch.cat([x, torch.zeros(-x.numel() % 1024)]).to(DEVICE)
    got = torch.empty(x.numel(), dtype=FP8, device=DEVICE)
    _round_kernel[(x.numel() // 1024,)](x, got, N=1024)
    assert torch.equal(got.view(torch.uint8), to_cache(x, FP8).view(torch.uint8))


def test_store_reference_writes_the_rounded_rows_and_skips_padding():
    cache = torch.zeros(3, 4, 2, 8, dtype=FP8), torch.zeros(3, 4, 2, 8, dtype=FP8)
    k, v = torch.randn(3, 2, 8) * 100, torch.randn(3, 2, 8)
    store_kv_reference(k, v, *cache, torch.tensor([5, -1, 11]))
    flat_k, flat_v = (c.view(12, 2, 8).float() for c in cache)
    assert torch.equal(flat_k[[5, 11]], to_cache(k[[0, 2]], FP8).float())
    assert torch.equal(flat_v[[5, 11]], to_cache(v[[0, 2]], FP8).float())
    assert flat_k.count_nonzero() == flat_k[[5, 11]].count_nonzero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_store_kv_into_fp8_rounds_as_the_reference(dtype, qk_norm):
    """v is stored bit for bit as the reference stores it; the rotated k may differ from the reference's in
    its last bit before rounding (summation order), so by at most one e4m3 step, and rarely."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 9, 3, 64
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    if not qk_norm:  # past e4m3's range: saturated, never NaN (a norm would bring them back into range)
        k[1, 0, :4] = torch.tensor([600.0, -900.0, 447.0, 1e4])
        v[3, 1, :2] = torch.tensor([-5e3, 500.0])
    pos = torch.tensor([0, 3, 17, 400, 77]).double()
    emb = torch.cat([pos[:, None] / (10000.0 ** (torch.arange(0, d, 2).double() / d))] * 2, -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    slots = torch.tensor([0, 17, -1, 40, 6], device=DEVICE)
    caches = [torch.zeros(4, 16, hkv, d, dtype=FP8, device=DEVICE) for _ in range(4)]
    norm = ()
    if qk_norm:
        norm = tuple((1 + 0.3 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) for _ in range(2)) + (1e-6,)
    got = rope_store_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, *norm)
    ref = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots, *norm)
    atol, rtol = POINTWISE_TOLERANCE[dtype]
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    k_got, k_ref = caches[0].float(), caches[2].float()
    # one step of 3 mantissa bits, past what the dtype's rounding of the rotation itself allows
    assert torch.allclose(k_got, k_ref, rtol=2 ** -3 + rtol, atol=2 ** -9 + atol)
    assert (k_got != k_ref).float().mean() < 0.02
    assert not torch.isnan(k_got).any() and not torch.isnan(caches[1].float()).any()
    if not qk_norm:
        assert caches[0].view(-1, hkv, d)[17].float().abs().max() == FP8_MAX
        assert caches[1].view(-1, hkv, d)[40, 1, :2].float().tolist() == [-FP8_MAX, FP8_MAX]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_reads_fp8(dtype, hq, hkv, d, num_splits):
    context_lens = [1, 17, 40, 129]
    k, v, table = fp8_cache(context_lens, hkv, d, 16)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(d)
    got = decode_attention_triton(q, k, v, table, ctx, scale, num_splits=num_splits, block_n=32)
    ref = decode_attention_reference(q, k, v, table, ctx, scale)
    last = [(s, n - 1) for s, n in enumerate(context_lens)]
    exact = float64_attention(q, k.float(), v.float(), table, context_lens, last)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_pairs_widen_alike_in_ptx_and_in_triton(dtype, monkeypatch):
    """On a GPU the pairs widen with one PTX conversion each (E4M3_PAIRS=2); Triton's byte split (1, the CPU
    interpreter's) gives the same fp16 values, so the two decode outputs are equal to the bit."""
    import rlcu.kernels.decode_attention as decode

    context_lens = [1, 17, 40, 129, 300]
    k, v, table = fp8_cache(context_lens, 8, 128, 16)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), 16, 128, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    ptx = decode_attention_triton(q, k, v, table, ctx, 1 / math.sqrt(128), num_splits=2)
    real = decode.kv_operands
    assert real(k, v, dtype)[2] == 2
    monkeypatch.setattr(decode, "kv_operands", lambda *a: (*real(*a)[:2], 1))
    split = decode_attention_triton(q, k, v, table, ctx, 1 / math.sqrt(128), num_splits=2)
    assert torch.equal(ptx, split)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_reads_fp8(dtype):
    context_lens, q_lens = [20, 5, 70], [7, 5, 40]  # a chunk after a cached prefix, a whole prompt, two query tiles
    k, v, table = fp8_cache(context_lens, 3, 64, 12, seed=4)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention_triton(q, k, v, cu, ctx, table, 1 / 8)
    ref = paged_attention_reference(q, k, v, cu, ctx, table, 1 / 8)
    positions = [(s, n - ql + i) for s, (n, ql) in enumerate(zip(context_lens, q_lens)) for i in range(ql)]
    exact = float64_attention(q, k.float(), v.float(), table, context_lens, positions)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_prefix_decode_reads_fp8(dtype):
    """Three samples forked from one prompt's two full blocks, and one sequence on its own."""
    bs, hq, hkv, d = 16, 9, 3, 64
    table = np.array([[0, 1, 2], [0, 1, 3], [0, 1, 4], [5, 6, 0]], dtype=np.int32)
    ctx = [40, 35, 33, 20]
    g = torch.Generator().manual_seed(2)
    k, v = (to_cache(torch.randn(7, bs, hkv, d, generator=g), FP8).to(DEVICE) for _ in range(2))
    q = torch.randn(len(ctx), hq, d, generator=g).to(dtype).to(DEVICE)
    order, starts, shared, skip = prefix_groups(table, bs, np.array(ctx))
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)  # noqa: E731
    t, c = dev(table), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    got = shared_prefix_decode_triton(q, k, v, t, c, dev(order), dev(starts), dev(shared), dev(skip), 1 / 8, 1, 2)
    exact = float64_attention(q, k.float(), v.float(), t.cpu(), ctx, [(s, n - 1) for s, n in enumerate(ctx)])
    atol, rtol = TOLERANCE[dtype]
    assert int(shared[0]) == 32  # the two full prompt blocks are read once for the three
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
