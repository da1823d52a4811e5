"""varlen_attention compiled for CUDA in bf16, at the head dims of the models that take it (gpt-oss 64, Gemma 2 256),
against float64 autograd of the PyTorch reference: within bf16's rounding of the inputs and outputs."""
import pytest
import torch

from rlcu.kernels.varlen_attention import varlen_attention, varlen_tiles
from tests.kernels.test_varlen_attention import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("d", "hq", "hkv", "window", "softcap", "sinks"),
                         [(64, 8, 2, None, None, True), (64, 8, 2, 128, None, True), (256, 8, 4, None, 50.0, False),
                          (256, 8, 4, 96, 50.0, False)])
def test_bf16_forward_and_gradients_on_cuda(d, hq, hkv, window, softcap, sinks):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 77, 300, 33]
    cut = torch.tensor([0, *lengths]).cumsum(0).tolist()
    bounds, t = list(zip(cut[:-1], cut[1:])), cut[-1]
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, generator=g, dtype=torch.float64) if sinks else None
    grad = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    inputs = [x.to(torch.bfloat16).double() for x in (q, k, v, *([sink] if sinks else []))]  # what bf16 holds
    leaves64 = [x.clone().requires_grad_() for x in inputs]
    want = reference(*leaves64[:3], bounds, t, d ** -0.5, window, leaves64[3] if sinks else None, softcap)
    want_grads = torch.autograd.grad(want, leaves64, grad)
    leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in inputs]
    got = varlen_attention(*leaves[:3], varlen_tiles(torch.tensor(cut[:-1]), torch.tensor(cut[1:]), "cuda"),
                           d ** -0.5, window, leaves[3] if sinks else None, softcap)
    got_grads = torch.autograd.grad(got, leaves, grad.to("cuda", torch.bfloat16))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (got, *got_grads), (want, *want_grads)):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 0.02 * b.abs().max().item() + 1e-3, (name, err)


def test_packed_sequences_of_one_length_through_causal_sdpa_on_cuda():
    """PackedAttention's row of sequences all max_len long, run as a batch through causal SDPA (cuDNN's kernels on
    Hopper), against float64 autograd of each sequence's own causal attention, as the test above bounds it."""
    from rlcu.models.attention import PackedAttention

    g = torch.Generator().manual_seed(2)
    n, length, hq, hkv, d = 4, 160, 16, 8, 128
    t = n * length
    q, k, v = (torch.randn(1, t, h, d, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
               for h in (hq, hkv, hkv))
    grad = torch.randn(1, t, hq, d, generator=g, dtype=torch.float64)
    leaves64 = [x.clone().requires_grad_() for x in (q, k, v)]
    bounds = [(i * length, (i + 1) * length) for i in range(n)]
    want = reference(*(x[0] for x in leaves64), bounds, t, d ** -0.5, None, None, None)[None]
    want_grads = torch.autograd.grad(want, leaves64, grad)
    leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)]
    cos, sin = torch.ones(1, t, 1, d, device="cuda"), torch.zeros(1, t, 1, d, device="cuda")
    module = PackedAttention(torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda"), length)
    got = module(0, *leaves, cos.bfloat16(), sin.bfloat16(), d ** -0.5)
    assert not module.masks
    got_grads = torch.autograd.grad(got, leaves, grad.to("cuda", torch.bfloat16))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 0.02 * b.abs().max().item() + 1e-3, (name, err)
