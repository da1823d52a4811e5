"""RMSNorm (+ fused residual) and SiLU-and-multiply: Triton against the reference and against float64
within the dtype's tolerance (both round at the same points; only summation order differs); odd widths."""
import pytest
import torch
import torch.nn.functional as F

from rlcu.kernels import _triton
from rlcu.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from rlcu.kernels.silu_mul import silu_mul_reference, silu_mul_triton

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 1024), (3, 5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=g).to(dtype).to(DEVICE) if with_residual else None
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    got, ref = rms_norm_triton(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    if with_residual:
        assert torch.equal(got[1], ref[1])
        got, ref = got[0], ref[0]
    s = (x.double() + (r.double() if with_residual else 0)).cpu()
    exact = w.double().cpu() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (13, 3072), (2, 3, 1000)])
def test_silu_mul(dtype, shape):
    g = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    up = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    gate_up = torch.cat([gate, up], -1)
    got, ref = silu_mul_triton(gate_up), silu_mul_reference(gate_up)
    assert got.shape == gate.shape
    exact = (F.silu(gate.double()) * up.double()).cpu()
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (8, 128), (3, 16), (4, 8)])
def test_rope(dtype, heads, head_dim):
    from rlcu.kernels.rope import rope_reference, rope_triton

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [40, 41, 42, 900, 901, 902, 5000]]).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)[:, :, None]
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    got, ref = rope_triton(x, cos, sin), rope_reference(x, cos, sin)
    x64, c64, s64 = x.double().cpu(), emb.cos(), emb.sin()
    exact = x64 * c64 + torch.cat((-x64[..., head_dim // 2:], x64[..., :head_dim // 2]), -1) * s64
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=4 * atol, rtol=rtol)  # cos/sin themselves are rounded
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (16, 8, 128), (2, 1, 16)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
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
    norm = ()
    if qk_norm:
        norm = tuple((1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2)) + (1e-6,)
    got = rope_store_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, *norm)
    ref = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots, *norm)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)
    assert torch.allclose(caches[0].double(), caches[2].double(), atol=atol, rtol=rtol)
    assert torch.equal(caches[1], caches[3])

    def rotate64(x, w=None):
        x64 = x.double().cpu()
        if w is not None:
            x64 = w.double().cpu() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
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


def _grads(fn, inputs, upstream):
    """Gradients of sum(out_i * upstream_i) with respect to each input."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, upstream[:len(outs)])
    return [x.grad for x in inputs]


def _close(got, exact, dtype, scale=1.0):
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact.cpu(), atol=scale * atol, rtol=scale * rtol), \
        (got.double().cpu() - exact.cpu()).abs().max()


def _rms64(x, w, residual=None, eps=1e-6):
    s = x + residual if residual is not None else x
    out = w * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (out, s) if residual is not None else out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 100), (130, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_backward(dtype, rows, width, with_residual):
    """dx, dweight (and the residual stream's pass-through gradient) against float64 autograd."""
    from rlcu.kernels.rmsnorm import RMSNormFunction

    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    up = [torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    if with_residual:
        got = _grads(lambda x, w, r: RMSNormFunction.apply(x, w, 1e-6, r), [x, w, r], up)
        exact = _grads(_rms64, [x.double(), w.double(), r.double()], [u.double() for u in up])
    else:
        got = _grads(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, None), [x, w], up)
        exact = _grads(_rms64, [x.double(), w.double()], [u.double() for u in up])
    for name, a, b in zip(("x", "weight", "residual"), got, exact):
        _close(a, b, dtype, scale=8 if name == "weight" else 2)  # dweight sums over every row


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_view_without_copy(dtype):
    """Qwen3's q-norm: heads of a strided view of the fused q/k/v output, forward and backward."""
    from rlcu.kernels.rmsnorm import RMSNormFunction, rms_norm_triton

    g = torch.Generator().manual_seed(5)
    heads, d, t = 3, 32, 5
    qkv = torch.randn(2, t, (heads + 2) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[..., :heads * d].unflatten(-1, (heads, d))
    assert not q.is_contiguous()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    _close(rms_norm_triton(q, w, 1e-6), _rms64(q.double(), w.double()), dtype)
    up = [torch.randn(q.shape, generator=g).to(dtype).to(DEVICE)]
    got = _grads(lambda q, w: RMSNormFunction.apply(q, w, 1e-6, None), [q, w], up)
    exact = _grads(_rms64, [q.double(), w.double()], [up[0].double()])
    _close(got[0], exact[0], dtype, scale=2)
    _close(got[1], exact[1], dtype, scale=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (13, 3072), (2, 3, 1000)])
def test_silu_mul_backward(dtype, shape):
    from rlcu.kernels.silu_mul import SiluMulFunction

    g = torch.Generator().manual_seed(6)
    gate_up = torch.cat([3 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)], -1).to(dtype).to(DEVICE)
    up = [torch.randn(shape, generator=g).to(dtype).to(DEVICE)]
    got = _grads(SiluMulFunction.apply, [gate_up], up)[0]
    exact = _grads(lambda x: silu_mul_reference(x), [gate_up.double()], [up[0].double()])[0]
    _close(got, exact, dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 16)])
def test_rope_backward(dtype, heads, head_dim):
    from rlcu.kernels.rope import RoPEFunction, rope_reference

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 7, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    pos = torch.arange(14).view(2, 7).double() * 37
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)[:, :, None]
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    up = [torch.randn(x.shape, generator=g).to(dtype).to(DEVICE)]
    got = _grads(lambda x: RoPEFunction.apply(x, cos, sin), [x], up)[0]
    exact = _grads(lambda x: rope_reference(x, cos.double(), sin.double()), [x.double()], [up[0].double()])[0]
    _close(got, exact, dtype, scale=4)


def test_rms_norm_with_a_wider_residual_keeps_its_dtype():
    """Under autocast the residual stream can be fp32 while a layer's output is fp16/bf16: x + residual
    promotes, and the stream, the rounding of the normed value and the gradients follow torch's types."""
    from rlcu.kernels.rmsnorm import RMSNormFunction

    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 96, generator=g).to(torch.float16).to(DEVICE)
    r = torch.randn(9, 96, generator=g).to(DEVICE)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE)
    got, ref = rms_norm_triton(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    assert got[1].dtype == ref[1].dtype == torch.float32 and torch.equal(got[1], ref[1])
    assert got[0].dtype == ref[0].dtype and torch.allclose(got[0], ref[0], atol=1e-5, rtol=1e-5)
    up = [torch.randn(9, 96, generator=g).to(DEVICE) for _ in range(2)]
    grads = _grads(lambda x, w, r: RMSNormFunction.apply(x, w, 1e-6, r), [x, w, r], up)
    exact = _grads(_rms64, [x.double(), w.double(), r.double()], [u.double() for u in up])
    assert [a.dtype for a in grads] == [torch.float16, torch.float32, torch.float32]
    for a, b in zip(grads, exact):
        _close(a, b, torch.float16, scale=8)
