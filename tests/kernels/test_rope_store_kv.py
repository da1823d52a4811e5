"""RoPE + KV-cache write (with Qwen3's and Gemma 3's q/k norms) against float64."""
import pytest
import torch

from rlcu.kernels import _triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE as TOLERANCE

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (16, 8, 128), (2, 1, 16)])
@pytest.mark.parametrize("qk_norm", [False, True, "offset"], ids=["plain", "qk_norm", "qk_norm_1_plus_w"])
def test_rope_store_kv(dtype, hq, hkv, head_dim, qk_norm):
    """The fused kernel reads q/k/v as strided views of one projection output (as the model hands them
    over), RMS-normalises each q/k head when given the weights (Qwen3), rotates q, rotates k into its
    cache slot, copies v, and skips slot -1."""
    from rlcu.kernels.rope_store_kv import rope_store_kv_reference, rope_store_kv_triton

    g = torch.Generator().manual_seed(3)
    t, block_size, blocks = 6, 16, 9
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype).to(DEVICE)
    q, k, v = (x.unflatten(-1, (-1, head_dim)) for x in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1))
    pos = torch.tensor([0, 3, 17, 400, 5, 4999]).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    slots = torch.tensor([0, 17, 131, -1, 5, 64], device=DEVICE)  # -1: a padding row writes nowhere
    caches = [torch.zeros(blocks, block_size, hkv, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    norm, offset = (), 1.0 if qk_norm == "offset" else 0.0
    if qk_norm:  # Gemma stores w and scales by 1 + w: the same scales as Qwen3's w
        norm = tuple((1 - offset + 0.3 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
                     for _ in range(2)) + (1e-6, offset)
    got = rope_store_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, *norm)
    ref = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots, *norm)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)
    assert torch.allclose(caches[0].double(), caches[2].double(), atol=atol, rtol=rtol)
    assert torch.equal(caches[1], caches[3])

    def rotate64(x, w=None):
        x64 = x.double().cpu()
        if w is not None:
            x64 = (offset + w.double().cpu()) * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        half = head_dim // 2
        return x64 * emb.cos()[:, None] + torch.cat((-x64[..., half:], x64[..., :half]), -1) * emb.sin()[:, None]

    q64, k64 = (rotate64(q, norm[0]), rotate64(k, norm[1])) if qk_norm else (rotate64(q), rotate64(k))
    assert torch.allclose(got.double().cpu(), q64, atol=4 * atol, rtol=rtol)  # cos/sin themselves are rounded
    flat_k = caches[0].view(-1, hkv, head_dim).double().cpu()
    keep = slots.cpu() >= 0
    assert torch.allclose(flat_k[slots.cpu()[keep]], k64[keep], atol=4 * atol, rtol=rtol)
    assert torch.equal(caches[1].view(-1, hkv, head_dim)[slots[keep]], v[keep.to(DEVICE)])
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[slots.cpu()[keep]] = True
    assert not caches[0].view(blocks * block_size, -1)[~written.to(DEVICE)].any(), "the -1 row was written somewhere"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim,rotary", [(4, 2, 128, 96), (9, 3, 64, 48), (3, 1, 32, 8)])
def test_partial_rotary(dtype, hq, hkv, head_dim, rotary):
    """Phi-3's and Qwen3.5's partial RoPE: tables `rotary` wide rotate each head's first `rotary` dims (halves of
    rotary / 2, not always a power of two) and the rest of q and k pass through unchanged, as transformers
    computes it; v is copied whole."""
    from rlcu.kernels.rope_store_kv import rope_store_kv_reference, rope_store_kv_triton

    g = torch.Generator().manual_seed(head_dim + rotary)
    t, block_size, blocks = 5, 16, 4
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    pos = torch.tensor([0, 2, 33, 700, 9]).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).double() / rotary))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 40, 7, 63], device=DEVICE)
    caches = [torch.zeros(blocks, block_size, hkv, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    got = rope_store_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots)
    ref = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)
    assert torch.allclose(caches[0].double(), caches[2].double(), atol=atol, rtol=rtol)
    assert torch.equal(caches[1], caches[3])

    def rotate64(x):
        x64, half = x.double().cpu(), rotary // 2
        r = x64[..., :rotary]
        turned = r * emb.cos()[:, None] + torch.cat((-r[..., half:], r[..., :half]), -1) * emb.sin()[:, None]
        return torch.cat([turned, x64[..., rotary:]], -1)

    assert torch.allclose(got.double().cpu(), rotate64(q), atol=4 * atol, rtol=rtol)
    assert torch.equal(got[..., rotary:], q[..., rotary:])
    keep = slots.cpu() >= 0
    flat_k = caches[0].view(-1, hkv, head_dim)[slots[keep.to(DEVICE)]]
    assert torch.allclose(flat_k.double().cpu(), rotate64(k)[keep], atol=4 * atol, rtol=rtol)
    assert torch.equal(flat_k[..., rotary:], k[keep.to(DEVICE)][..., rotary:])
    assert torch.equal(caches[1].view(-1, hkv, head_dim)[slots[keep.to(DEVICE)]], v[keep.to(DEVICE)])
