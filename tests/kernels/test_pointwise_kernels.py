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
    got, ref = silu_mul_triton(gate, up), silu_mul_reference(gate, up)
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
