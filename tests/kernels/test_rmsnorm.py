"""RMSNorm (+residual, or gated) forward and backward against float64 and the PyTorch reference."""
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE as TOLERANCE
from tests.helpers import assert_close, grads

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 1024), (3, 5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype, shape, with_residual, offset):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=g).to(dtype).to(DEVICE) if with_residual else None
    w = (1 - offset + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)  # Gemma stores w, scales by 1 + w
    got, ref = rms_norm_triton(x, w, 1e-6, r, offset=offset), rms_norm_reference(x, w, 1e-6, r, offset)
    if with_residual:
        assert torch.equal(got[1], ref[1])
        got, ref = got[0], ref[0]
    s = (x.double() + (r.double() if with_residual else 0)).cpu()
    exact = (offset + w.double().cpu()) * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 100), (130, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_backward(dtype, rows, width, with_residual, offset):
    """dx, dweight (and the residual stream's pass-through gradient) against float64 autograd."""
    from rlcu.kernels.rmsnorm import RMSNormFunction

    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 - offset + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    up = [torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    ref = lambda *a: _rms64(*a, offset=offset)  # noqa: E731
    if with_residual:
        got = grads(lambda x, w, r: RMSNormFunction.apply(x, w, 1e-6, r, offset), [x, w, r], up)
        exact = grads(ref, [x.double(), w.double(), r.double()], [u.double() for u in up])
    else:
        got = grads(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, None, offset), [x, w], up)
        exact = grads(ref, [x.double(), w.double()], [u.double() for u in up])
    for name, a, b in zip(("x", "weight", "residual"), got, exact):
        assert_close(a, b, dtype, scale=8 if name == "weight" else 2)  # dweight sums over every row


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
    assert_close(rms_norm_triton(q, w, 1e-6), _rms64(q.double(), w.double()), dtype)
    up = [torch.randn(q.shape, generator=g).to(dtype).to(DEVICE)]
    got = grads(lambda q, w: RMSNormFunction.apply(q, w, 1e-6, None), [q, w], up)
    exact = grads(_rms64, [q.double(), w.double()], [up[0].double()])
    assert_close(got[0], exact[0], dtype, scale=2)
    assert_close(got[1], exact[1], dtype, scale=8)


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
    got_grads = grads(lambda x, w, r: RMSNormFunction.apply(x, w, 1e-6, r), [x, w, r], up)
    exact = grads(_rms64, [x.double(), w.double(), r.double()], [u.double() for u in up])
    assert [a.dtype for a in got_grads] == [torch.float16, torch.float32, torch.float32]
    for a, b in zip(got_grads, exact):
        assert_close(a, b, torch.float16, scale=8)


def _rms64(x, w, residual=None, eps=1e-6, offset=0.0):
    s = x + residual if residual is not None else x
    out = (offset + w) * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (out, s) if residual is not None else out


def test_a_rows_bits_do_not_depend_on_the_rows_around_it():
    """Exact numerics' gated norm (rlcu/models/linear_attention.py): each value head's output of 6 (the GPU exact
    test's tiny hybrid) or 128 wide, normed alone, among a decode step's rows or among a training forward's, is the
    same bits."""
    g = torch.Generator().manual_seed(3)
    for width in (6, 128):
        x = torch.randn(300, 4, width, generator=g).to(DTYPES[-1]).to(DEVICE)
        z = torch.randn(300, 4, width, generator=g).to(DTYPES[-1]).to(DEVICE)
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(DEVICE)
        for gate in (None, z):  # the plain form too: exact numerics' other norms
            full = rms_norm_triton(x, w, 1e-6, gate=gate)
            for rows in (slice(0, 1), slice(5, 12), slice(100, 164), slice(299, 300)):
                part = rms_norm_triton(x[rows], w, 1e-6, gate=None if gate is None else gate[rows])
                assert torch.equal(part, full[rows])


def _gated64(x, w, gate, eps=1e-6):
    return _rms64(x, w, eps=eps) * torch.nn.functional.silu(gate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,width", [(1, 6), (3, 40), (16, 128)])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_gated_rms_norm(dtype, heads, width, weight_fp32):
    """Gated DeltaNet's output norm on a strided view of the gate (the z rows of the layer's fused projection),
    with the weight in x's dtype or in fp32 (mixed precision): float64, and the PyTorch reference's types."""
    from rlcu.kernels.rmsnorm import GatedRMSNormFunction

    g = torch.Generator().manual_seed(6)
    rows = 37
    x = torch.randn(rows, heads, width, generator=g).to(dtype).to(DEVICE)
    proj = torch.randn(rows, (heads + 1) * width + 5, generator=g).to(dtype).to(DEVICE)
    gate = proj[:, width:width + heads * width].unflatten(-1, (heads, width))
    assert not gate.is_contiguous()
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.float32 if weight_fp32 else dtype).to(DEVICE)
    got, ref = rms_norm_triton(x, w, 1e-6, gate=gate), rms_norm_reference(x, w, 1e-6, gate=gate)
    assert got.dtype == ref.dtype == dtype
    exact = _gated64(x.double(), w.double(), gate.double())
    assert_close(got, exact, dtype, scale=2)
    assert_close(ref, exact, dtype, scale=2)
    up = [torch.randn(x.shape, generator=g).to(dtype).to(DEVICE)]
    got_grads = grads(lambda x, w, z: GatedRMSNormFunction.apply(x, w, z, 1e-6), [x, w, gate], up)
    exact_grads = grads(_gated64, [x.double(), w.double(), gate.double()], [up[0].double()])
    assert [a.dtype for a in got_grads] == [dtype, w.dtype, dtype]
    for name, a, b in zip(("x", "weight", "gate"), got_grads, exact_grads):
        assert_close(a, b, dtype, scale=16 if name == "weight" else 4)  # dweight sums over every row


def test_gated_rms_norm_refuses_a_residual():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="gated RMSNorm"):
        rms_norm_triton(x, torch.ones(8, device=DEVICE), 1e-6, x, gate=x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_scales_x_before_the_residual_add_as_granite_does(dtype):
    """Granite's `residual + branch * multiplier` then the norm: the product rounded to x's dtype as torch rounds it
    (the unfused ops' bits), and the backward against float64 autograd of the same product."""
    from rlcu.kernels.rmsnorm import RMSNormFunction

    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(37, 100, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(100, generator=g)).to(dtype).to(DEVICE)
    got = rms_norm_triton(x, w, 1e-6, r, x_scale=0.22)
    unfused = rms_norm_triton(x * 0.22, w, 1e-6, r)  # the multiply as its own op, then the norm's launch
    assert torch.equal(got[0], unfused[0]) and torch.equal(got[1], unfused[1])
    assert torch.equal(got[1], rms_norm_reference(x, w, 1e-6, r, x_scale=0.22)[1])
    assert torch.equal(got[1], r + x * 0.22)
    assert not torch.equal(got[1], rms_norm_triton(x, w, 1e-6, r)[1])  # the scale is applied at all
    up = [torch.randn(37, 100, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    got_grads = grads(lambda x, w, r: RMSNormFunction.apply(x, w, 1e-6, r, 0.0, 0.22), [x, w, r], up)
    exact = grads(lambda x, w, r: _rms64(x * 0.22, w, r), [x.double(), w.double(), r.double()],
                  [u.double() for u in up])
    for name, a, b in zip(("x", "weight", "residual"), got_grads, exact):
        assert_close(a, b, dtype, scale=8 if name == "weight" else 2)
    # without a residual (a model's first norm, on the embeddings) the scale is not applied, forward or backward
    plain = grads(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, None), [x, w], up[:1])
    scaled = grads(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, None, 0.0, 0.22), [x, w], up[:1])
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))
    assert torch.equal(rms_norm_triton(x, w, 1e-6, x_scale=0.22), rms_norm_triton(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("stream_fp32", [False, True])
def test_rms_norm_added_to_the_stream_as_olmo_post_norm_does(dtype, offset, stream_fp32):
    """OLMo's `x + norm(branch)` in the norm's launch: the bits of the unfused norm then add (the norm rounded to its
    own dtype first, the sum once; a float32 stream as under autocast), and the backward's against float64."""
    from rlcu.kernels.rmsnorm import RMSNormFunction

    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 100, generator=g).to(dtype).to(DEVICE)
    s = torch.randn(37, 100, generator=g).to(torch.float32 if stream_fp32 else dtype).to(DEVICE)
    w = (1 - offset + 0.1 * torch.randn(100, generator=g)).to(dtype).to(DEVICE)
    got = rms_norm_triton(x, w, 1e-6, offset=offset, add_to=s)
    unfused = s + rms_norm_triton(x, w, 1e-6, offset=offset)
    assert got.dtype == unfused.dtype and torch.equal(got, unfused)
    ref = rms_norm_reference(x, w, 1e-6, offset=offset, add_to=s)
    assert ref.dtype == got.dtype and torch.allclose(got, ref, *TOLERANCE[dtype])
    up = [torch.randn(37, 100, generator=g).to(got.dtype).to(DEVICE)]
    got_grads = grads(lambda x, w, s: RMSNormFunction.apply(x, w, 1e-6, None, offset, 1.0, s), [x, w, s], up)
    unfused_grads = grads(lambda x, w, s: s + RMSNormFunction.apply(x, w, 1e-6, None, offset), [x, w, s], up)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, unfused_grads))
    exact = grads(lambda x, w, s: s + _rms64(x, w, offset=offset), [x.double(), w.double(), s.double()],
                  [u.double() for u in up])
    for name, a, b in zip(("x", "weight", "stream"), got_grads, exact):
        assert_close(a, b, dtype, scale=8 if name == "weight" else 2)


def test_rms_norm_added_to_the_stream_refuses_a_residual_or_a_gate():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="add_to"):
        rms_norm_triton(x, torch.ones(8, device=DEVICE), 1e-6, x, add_to=x)
