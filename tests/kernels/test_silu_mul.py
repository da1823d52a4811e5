"""SiLU-mul forward and backward against float64 and the PyTorch reference."""
import pytest
import torch
import torch.nn.functional as F

from rlcu.kernels import _triton
from rlcu.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE as TOLERANCE
from tests.helpers import assert_close, grads

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


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
@pytest.mark.parametrize("shape", [(1, 1536), (13, 3072), (2, 3, 1000)])
def test_silu_mul_backward(dtype, shape):
    from rlcu.kernels.silu_mul import SiluMulFunction

    g = torch.Generator().manual_seed(6)
    gate_up = torch.cat([3 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)], -1).to(dtype).to(DEVICE)
    up = [torch.randn(shape, generator=g).to(dtype).to(DEVICE)]
    got = grads(SiluMulFunction.apply, [gate_up], up)[0]
    exact = grads(lambda x: silu_mul_reference(x), [gate_up.double()], [up[0].double()])[0]
    assert_close(got, exact, dtype, scale=2)
