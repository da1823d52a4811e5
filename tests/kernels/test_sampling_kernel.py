"""The Triton sampler against exact float64 distributions and the reference's filters, on the CPU
under TRITON_INTERPRET=1 and on the GPU as it is."""
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.sampling import filter_logits, sample_triton

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROBS = torch.tensor([0.45, 0.3, 0.15, 0.06, 0.04], dtype=torch.float64)  # 5 tokens: an odd vocabulary


def seeds(n, start=0):
    return torch.arange(start, start + n, dtype=torch.int64, device=DEVICE) * 7919 + 11


def allowed(logits, temperature, top_k, top_p, min_p):
    """Which tokens the reference's filters keep, computed in float64."""
    return torch.isfinite(filter_logits(logits.double().cpu() / temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("kw,kept", [
    (dict(), [0.45, 0.3, 0.15, 0.06, 0.04]),
    (dict(top_k=2), [0.45, 0.3, 0, 0, 0]),
    (dict(top_p=0.7), [0.45, 0.3, 0, 0, 0]),   # mass above token 2 is 0.75 >= 0.7: dropped
    (dict(top_p=0.8), [0.45, 0.3, 0.15, 0, 0]),
    (dict(min_p=0.3), [0.45, 0.3, 0.15, 0, 0]),  # keeps p >= 0.3 * 0.45
    (dict(top_k=3, top_p=0.6), [0.45, 0.3, 0, 0, 0]),  # top-p of the renormalised top-3 mass
    (dict(top_k=1), [1, 0, 0, 0, 0]),
])
def test_draws_follow_the_filtered_distribution(kw, kept):
    n = 400  # the interpreter runs programs one by one
    logits = PROBS.log().float().expand(n, 5).contiguous().to(DEVICE)
    # 12 halvings of a range of 3.4 (to 0.001) resolve these logits (0.4 apart at least) and keep the interpreter quick
    tokens, logps = sample_triton(logits, 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0), seeds(n),
                                  steps=12)
    freq = torch.bincount(tokens.cpu(), minlength=5).double() / n
    expected = torch.tensor(kept, dtype=torch.float64)
    expected /= expected.sum()
    assert (freq[expected == 0] == 0).all(), f"a filtered token was drawn: {freq}"
    assert (freq - expected).abs().max() < 0.09, freq  # 3.5 sigma at n = 400
    assert torch.allclose(logps.double().cpu(), PROBS.log()[tokens.cpu()], atol=1e-6)


def test_logprob_is_of_the_scaled_full_distribution_in_float64():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 333, generator=g) * 3).to(DEVICE)
    tokens, logps = sample_triton(logits, 0.7, 20, 0.9, 0.0, seeds(7))
    exact = torch.log_softmax(logits.double().cpu() / 0.7, -1)
    assert torch.allclose(logps.double().cpu(), exact[torch.arange(7), tokens.cpu()], atol=1e-5)
    assert allowed(logits, 0.7, 20, 0.9, 0.0)[torch.arange(7), tokens.cpu()].all()


def test_a_row_draws_the_same_token_whatever_batch_it_is_in():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g).to(DEVICE)
    s = seeds(6, start=100)
    together, _ = sample_triton(logits, 1.0, 0, 1.0, 0.0, s)
    alone = torch.stack([sample_triton(logits[i:i + 1], 1.0, 0, 1.0, 0.0, s[i:i + 1])[0][0] for i in range(6)])
    assert torch.equal(together, alone)
    other, _ = sample_triton(logits, 1.0, 0, 1.0, 0.0, seeds(6, start=200))
    assert not torch.equal(together, other)


@pytest.mark.parametrize("rows,vocab", [(3, 3001), pytest.param(64, 151936, marks=pytest.mark.gpu)])
def test_filters_over_a_chunked_vocabulary(rows, vocab):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(DEVICE)
    for top_k, top_p, min_p in [(50, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (40, 0.8, 0.05)]:
        tokens, logps = sample_triton(logits, 1.0, top_k, top_p, min_p, seeds(rows))
        keep = allowed(logits, 1.0, top_k, top_p, min_p)
        assert keep[torch.arange(rows), tokens.cpu()].all(), (top_k, top_p, min_p)
        exact = torch.log_softmax(logits.double().cpu(), -1)[torch.arange(rows), tokens.cpu()]
        assert torch.allclose(logps.double().cpu(), exact, atol=1e-4)


def test_unfiltered_draws_over_a_vocabulary_shared_among_programs():
    """No filter: each row's vocabulary is split among programs; the merged draw follows the distribution
    and its logprob is of the whole vocabulary."""
    from rlcu.kernels import sampling

    n, vocab = 400, 3001
    where = torch.tensor([2990, 10, 1500, 1100, 2047])  # the five tokens, in different shares
    logits = torch.full((n, vocab), -40.0, dtype=torch.float64)
    logits[:, where] = PROBS.log()
    tokens, logps = sample_triton(logits.float().to(DEVICE), 1.0, 0, 1.0, 0.0, seeds(n))
    assert -(-vocab // 1024) > 1 and sampling.PROGRAMS // n > 1  # several shares per row
    freq = torch.stack([(tokens.cpu() == w).double().mean() for w in where])
    assert freq.sum() == 1 and (freq - PROBS).abs().max() < 0.09, freq
    assert torch.allclose(logps.double().cpu(), torch.log_softmax(logits, -1)[torch.arange(n), tokens.cpu()], atol=1e-5)


def test_splitting_the_vocabulary_does_not_change_the_draw(monkeypatch):
    from rlcu.kernels import sampling

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 5000, generator=g) * 2).to(DEVICE)
    split, split_lp = sample_triton(logits, 0.9, 0, 1.0, 0.0, seeds(4))
    monkeypatch.setattr(sampling, "PROGRAMS", 1)  # one program per row scans the whole vocabulary
    whole, whole_lp = sample_triton(logits, 0.9, 0, 1.0, 0.0, seeds(4))
    assert torch.equal(split, whole)
    assert torch.allclose(split_lp, whole_lp, atol=1e-5)
    exact = torch.log_softmax(logits.double().cpu() / 0.9, -1)[torch.arange(4), split.cpu()]
    assert torch.allclose(split_lp.double().cpu(), exact, atol=1e-5)


def test_the_four_uniforms_of_one_philox_counter_draw_independently():
    """Tokens 4i .. 4i + 3 share a Philox counter (sampling._gumbel): over equal logits
    an eighth of the draws goes to each of 8 tokens, whatever its place among the four (were the four equal,
    the first of each would win every tie)."""
    n = 400
    tokens, _ = sample_triton(torch.zeros(n, 8, device=DEVICE), 1.0, 0, 1.0, 0.0, seeds(n))
    freq = torch.bincount(tokens.cpu(), minlength=8).double() / n
    assert (freq - 1 / 8).abs().max() < 0.06, freq  # 3.6 sigma at n = 400


def test_repetition_penalty_is_transformers_logits_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    from rlcu.kernels.sampling import penalize_repeats

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seen = [[1, 4, 4, 9], [], [0, 49, 7]]
    for penalty in (1.3, 0.8):
        got = penalize_repeats(logits, seen, penalty)
        for i, ids in enumerate(seen):
            processor = RepetitionPenaltyLogitsProcessor(penalty)
            want = processor(torch.tensor([ids], dtype=torch.long), logits[i:i + 1].clone()) if ids else logits[i:i + 1]
            assert torch.equal(got[i:i + 1], want)
