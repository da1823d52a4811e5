"""RoPE forward and backward (the inverse rotation) against float64 and the PyTorch reference."""
import pytest
import torch

from rlcu.kernels import _triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES
from tests.helpers import POINTWISE_TOLERANCE as TOLERANCE
from tests.helpers import assert_close, grads

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


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
    got = grads(lambda x: RoPEFunction.apply(x, cos, sin), [x], up)[0]
    exact = grads(lambda x: rope_reference(x, cos.double(), sin.double()), [x.double()], [up[0].double()])[0]
    assert_close(got, exact, dtype, scale=4)
