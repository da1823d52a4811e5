"""The experts' routing, dispatch and combine kernels against their references (PyTorch's ops, float64): the same
integers, the same bits where the trainer needs them, on odd shapes."""
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.moe_dispatch import (
    MAX_PAIRS,
    combine,
    combine_reference,
    dispatch,
    dispatch_reference,
    route,
    route_reference,
)
from tests.helpers import KERNEL_DEVICE as DEVICE

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")


def picks(tokens: int, experts: int, k: int, seed: int, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(tokens, experts, generator=g)
    if skew:  # most tokens pick the same few experts: long runs of one expert, and experts with no rows
        logits[:, :3] += 2
    return logits.topk(k, dim=-1).indices.to(DEVICE)


@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 2), (7, 5, 3), (64, 128, 8), (33, 32, 4), (300, 60, 8),
                                              (MAX_PAIRS // 8, 128, 8), (5, 1, 1)])
@pytest.mark.parametrize("skew", [False, True])
def test_dispatch_matches_the_stable_sort(monkeypatch, tokens, experts, k, skew):
    monkeypatch.setenv("RLCU_TRITON", "1")
    e = picks(tokens, experts, k, tokens + experts, skew)
    got, ref = dispatch(e, experts), dispatch_reference(e, experts)
    for name in ref._fields:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.ends.dtype == torch.int32 and got.order.dtype == torch.int64


def test_past_the_kernels_size_the_reference_runs(monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    e = picks(MAX_PAIRS // 8 + 1, 16, 8, 3)
    got, ref = dispatch(e, 16), dispatch_reference(e, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])
@pytest.mark.parametrize("tokens,k,hidden", [(1, 1, 8), (5, 3, 100), (64, 8, 2049)])
def test_combine_gives_the_unfused_ops_bits(monkeypatch, dtype, weight_dtype, tokens, k, hidden):
    monkeypatch.setenv("RLCU_TRITON", "1")
    g = torch.Generator().manual_seed(tokens * k)
    e = picks(tokens, 2 * k + 1, k, 7)
    d = dispatch_reference(e, 2 * k + 1)
    y = (4 * torch.randn(tokens * k, hidden, generator=g)).to(DEVICE, dtype)
    w = torch.rand(tokens, k, generator=g).softmax(-1).to(DEVICE, weight_dtype)
    got, ref = combine(y, d, w), combine_reference(y, d, w)
    assert got.dtype == ref.dtype == torch.promote_types(dtype, weight_dtype)
    assert torch.equal(got, ref)
    slots = y.double()[d.positions].view(tokens, k, hidden)
    exact = (slots * w.double()[..., None]).sum(1).cpu()
    assert torch.allclose(got.double().cpu(), exact, rtol=2e-2 if dtype == torch.float16 else 1e-5, atol=1e-2)


def test_combine_with_a_gradient_takes_the_differentiable_path(monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    e = picks(6, 5, 2, 1)
    d = dispatch_reference(e, 5)
    y = torch.randn(12, 16, device=DEVICE, requires_grad=True)
    w = torch.rand(6, 2, device=DEVICE, requires_grad=True)
    combine(y, d, w).sum().backward()
    assert y.grad is not None and w.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 1), (13, 60, 6), (64, 128, 8), (40, 32, 4), (3, 256, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_picks_the_references_experts(monkeypatch, dtype, tokens, experts, k, normalize):
    monkeypatch.setenv("RLCU_TRITON", "1")
    g = torch.Generator().manual_seed(tokens + k)
    logits = (3 * torch.randn(tokens, experts, generator=g)).to(DEVICE, dtype)
    (w, e), (rw, re) = route(logits, k, normalize), route_reference(logits, k, normalize)
    assert e.dtype == re.dtype == torch.int64 and w.dtype == rw.dtype == dtype
    # the same logits picked in the same (descending) order; among equal logits (fp16 has ties) any of them
    assert torch.equal(logits.gather(-1, e), logits.gather(-1, re))
    assert all(len(set(row)) == k for row in e.tolist())
    probs = torch.softmax(logits.double(), -1).gather(-1, e)
    exact = probs / probs.sum(-1, keepdim=True) if normalize else probs
    assert torch.allclose(w.double(), exact, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)


def test_route_with_a_gradient_or_many_experts_takes_the_reference(monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    logits = torch.randn(5, 8, device=DEVICE, requires_grad=True)
    route(logits, 2, True)[0].sum().backward()
    assert logits.grad is not None
    big = torch.randn(3, 300, device=DEVICE)
    assert torch.equal(route(big, 4, False)[1], route_reference(big, 4, False)[1])


def test_a_row_of_nans_still_routes_to_experts_of_the_model(monkeypatch):
    """A diverged model's NaN logits: the picks stay valid expert indices (the kernels after index by them)."""
    monkeypatch.setenv("RLCU_TRITON", "1")
    logits = torch.randn(4, 12, device=DEVICE)
    logits[1] = float("nan")
    experts = route(logits, 3, True)[1]
    assert int(experts.min()) >= 0 and int(experts.max()) < 12
    assert torch.equal(experts[[0, 2, 3]], route_reference(logits, 3, True)[1][[0, 2, 3]])
