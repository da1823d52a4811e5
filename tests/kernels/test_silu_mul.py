"""The gated MLP's activation (SiLU, tanh-GELU) times up, forward and backward, against float64 and PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from rlcu.kernels import _triton
from rlcu.kernels.silu_mul import gated_mul_reference, gated_mul_triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE as TOLERANCE
from tests.helpers import assert_close, grads

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (13, 3072), (2, 3, 1000)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mul(dtype, shape, activation):
    g = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    up = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    gate_up = torch.cat([gate, up], -1)
    got, ref = gated_mul_triton(gate_up, activation), gated_mul_reference(gate_up, activation)
    assert got.shape == gate.shape
    act = F.silu if activation == "silu" else lambda x: F.gelu(x, approximate="tanh")
    exact = (act(gate.double()) * up.double()).cpu()
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol)
    assert torch.allclose(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (13, 3072), (2, 3, 1000)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mul_backward(dtype, shape, activation):
    from rlcu.kernels.silu_mul import GatedMulFunction

    g = torch.Generator().manual_seed(6)
    gate_up = torch.cat([3 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)], -1).to(dtype).to(DEVICE)
    up = [torch.randn(shape, generator=g).to(dtype).to(DEVICE)]
    got = grads(lambda x: GatedMulFunction.apply(x, activation), [gate_up], up)[0]
    exact = grads(lambda x: gated_mul_reference(x, activation), [gate_up.double()], [up[0].double()])[0]
    assert_close(got, exact, dtype, scale=2)
