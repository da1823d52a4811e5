"""Training attention of layers with soft-capped scores or sinks: through rlcu's varlen kernel (as on CUDA in 16 bits,
here under the Triton interpreter in fp32) it equals the PyTorch form (`sdpa`), outputs and gradients, for padded
batches and packed sequences."""
import pytest
import torch

from rlcu.models import attention

pytest.importorskip("triton")


def run(module, q, k, v, sinks, scale, window, softcap, weight):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *([sinks] if sinks is not None else []))]
    cos, sin = torch.ones(*q.shape[:2], 1, q.shape[-1]), torch.zeros(*q.shape[:2], 1, q.shape[-1])
    out = module(0, *leaves[:3], cos, sin, scale, window, leaves[3] if sinks is not None else None, softcap)
    return out, torch.autograd.grad((out * weight).sum(), leaves)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("softcap", "sinks", "window"), [(2.0, False, None), (None, True, None), (1.5, True, 5)])
def test_capped_and_sink_layers_through_the_kernel_equal_sdpa(monkeypatch, layout, softcap, sinks, window):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 4, 2, 16
    if layout == "padded":
        mask = torch.ones(3, 23, dtype=torch.bool)
        mask[0, :3], mask[0, -2:], mask[2, :10] = False, False, False
        shape = (3, 23)
        make = lambda: attention.PaddedAttention(mask)  # noqa: E731 - a fresh one a run: it caches its masks
        weight_rows = mask[:, :, None, None].float()  # padding rows' outputs are never read
    else:
        cu = torch.tensor([0, 1, 8, 45, 50], dtype=torch.int32)
        shape = (1, 50)
        make = lambda: attention.PackedAttention(cu, 37)  # noqa: E731
        weight_rows = torch.ones(1, 50, 1, 1)
    q, k, v = (torch.randn(*shape, h, d, generator=g) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, generator=g) if sinks else None
    weight = torch.randn(*shape, hq, d, generator=g) * weight_rows
    want, want_grads = run(make(), q, k, v, sink, 0.3, window, softcap, weight)
    calls = []
    monkeypatch.setattr(attention, "capped_or_sinks_kernel", lambda q_, s_, c_: calls.append(1) or True)
    got, got_grads = run(make(), q, k, v, sink, 0.3, window, softcap, weight)
    assert calls
    torch.testing.assert_close(got * weight_rows, want * weight_rows, atol=2e-5, rtol=2e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_packed_sequences_of_one_length_attend_as_a_batch():
    """A packed row whose sequences are all max_len long runs as an [n, max_len] batch through causal SDPA (no
    [T, T] block-diagonal mask built): outputs and gradients equal each sequence's causal attention in float64."""
    g = torch.Generator().manual_seed(1)
    n, length, hq, hkv, d = 3, 7, 4, 2, 16
    cu = torch.arange(0, n * length + 1, length, dtype=torch.int32)
    q, k, v = (torch.randn(1, n * length, h, d, generator=g) for h in (hq, hkv, hkv))
    weight = torch.randn(1, n * length, hq, d, generator=g)
    module = attention.PackedAttention(cu, length)
    got, got_grads = run(module, q, k, v, None, 0.3, None, None, weight)
    assert not module.masks
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    outs = []
    for i in range(n):
        qi, ki, vi = (x[0, i * length:(i + 1) * length].transpose(0, 1) for x in leaves)
        ki, vi = ki.repeat_interleave(hq // hkv, 0), vi.repeat_interleave(hq // hkv, 0)
        scores = (qi @ ki.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(length, length).tril().bool(), -torch.inf)
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
    want = torch.cat(outs)[None]
    want_grads = torch.autograd.grad((want * weight.double()).sum(), leaves)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
