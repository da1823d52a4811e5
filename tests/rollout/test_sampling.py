"""The sampler against exact distributions computed in float64."""
import pytest
import torch

from rlcu.kernels.sampling import sample_reference

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)).float()


def draw(n=20000, **kw):
    g = torch.Generator().manual_seed(0)
    tokens, logps = sample_reference(LOGITS.expand(n, 4), generator=g, **kw)
    return torch.bincount(tokens, minlength=4).double() / n, tokens, logps


def test_greedy_and_its_logprob():
    tok, lp = sample_reference(LOGITS, temperature=0)
    assert tok.item() == 0 and lp.item() == pytest.approx(torch.log(torch.tensor(0.5)).item(), abs=1e-6)


@pytest.mark.parametrize("kw,kept", [
    (dict(), [0.5, 0.3, 0.15, 0.05]),
    (dict(top_k=2), [0.5, 0.3, 0, 0]),
    (dict(top_p=0.7), [0.5, 0.3, 0, 0]),   # mass before token 2 is 0.8 >= 0.7: dropped
    (dict(top_p=0.85), [0.5, 0.3, 0.15, 0]),
    (dict(min_p=0.5), [0.5, 0.3, 0, 0]),   # keeps p >= 0.5 * 0.5
    (dict(top_k=1), [1, 0, 0, 0]),
])
def test_filters_give_the_renormalised_distribution(kw, kept):
    freq, _, _ = draw(**kw)
    expected = torch.tensor(kept, dtype=torch.float64)
    expected /= expected.sum()
    assert (freq - expected).abs().max() < 0.015


def test_temperature_and_reported_logprob():
    freq, tokens, logps = draw(temperature=2.0, top_k=3)
    full = torch.log_softmax(LOGITS.double() / 2.0, -1)[0]
    # the logprob is of the temperature-scaled full distribution (what the trainer recomputes), not the filtered one
    assert torch.allclose(logps.double(), full[tokens], atol=1e-6)
    expected = full[:3].exp() / full[:3].exp().sum()
    assert (freq[:3] - expected).abs().max() < 0.015 and freq[3] == 0


def test_same_seed_same_tokens():
    logits = torch.randn(64, 100)
    a = sample_reference(logits, generator=torch.Generator().manual_seed(3))[0]
    b = sample_reference(logits, generator=torch.Generator().manual_seed(3))[0]
    c = sample_reference(logits, generator=torch.Generator().manual_seed(4))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
