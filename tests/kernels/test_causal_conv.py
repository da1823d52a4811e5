"""Gated DeltaNet's convolution kernels (`rlcu/kernels/causal_conv.py`, interpreted on the CPU) against the PyTorch
form of `gated_delta.causal_conv` and float64."""
import pytest
import torch

from rlcu.kernels._triton import HAS_TRITON
from rlcu.kernels.gated_delta import causal_conv


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("k", [4, 3])
def test_the_convolution_kernels_against_pytorch_and_float64(monkeypatch, dtype, with_window, k):
    """Training's and prefill's convolution in Triton (`causal_conv.causal_conv_triton`, interpreted on the CPU)
    against the PyTorch form's output, last windows and gradients, and against float64: sequences shorter than the
    window and across the kernel's blocks of tokens (16) and channels (37: a partial block), x a strided view, an
    empty sequence among them."""
    from rlcu.kernels import causal_conv as kernels

    monkeypatch.setattr(kernels, "BLOCKS_A_PROGRAM", 2)  # the weight's gradient in three programs' shares
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    lengths, c = [1, 2, 0, 19, 40, 5], 37
    t, n = sum(lengths), len(lengths)
    rows = torch.randn(t, c + 5, generator=gen)
    w = torch.randn(c, k, generator=gen)
    window = torch.randn(n, c, k - 1, generator=gen) if with_window else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    dy = torch.randn(t, c, generator=gen)

    def run(triton_kernel, to, dev):
        if triton_kernel:
            monkeypatch.setenv("RLCU_TRITON", "1")
        else:
            monkeypatch.delenv("RLCU_TRITON", raising=False)
        x = rows.to(dev, to).clone()[:, 5:].requires_grad_()  # a strided view, as the layer's projection
        weight = w.to(dev, to).clone().requires_grad_()
        win = window.to(dev, torch.float64 if to == torch.float64 else torch.float32) if with_window else None
        out, last = causal_conv(x, weight, cu.to(dev), win)  # an fp32 window beside fp16 x, as a pool may hold
        out.backward(dy.to(dev, to))
        return [a.detach().cpu().double() for a in (out, last, x.grad, weight.grad)]

    got = run(True, dtype, device)
    want = run(False, dtype, "cpu") if device == "cpu" else run(False, dtype, device)
    exact = run(False, torch.float64, "cpu")
    names = ("out", "last", "dx", "dw")
    for name, a, b, e in zip(names, got, want, exact):
        scale = 1 + e.abs().max()
        if name == "last":
            assert torch.equal(a, b), name
        elif dtype == torch.float32:
            assert (a - b).abs().max() < 1e-5 * scale and (a - e).abs().max() < 1e-5 * scale, name
        else:  # fp16: the kernel's fp32 gradients no further from float64 than PyTorch's fp16 ones, give or take
            assert (a - e).abs().max() <= 2 * (b - e).abs().max() + 1e-3 * scale, name
