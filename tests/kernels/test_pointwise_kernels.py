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
