"""The LM head's one-pass log-probability / entropy kernel and its in-place gradient, against float64 and
the PyTorch reference; a vocabulary that is not a multiple of the block, extreme logits, a temperature."""
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.token_logprob import (
    BLOCK,
    token_logprob_backward_reference,
    token_logprob_backward_triton_,
    token_logprob_reference,
    token_logprob_triton,
)

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}  # the logits are the inputs: exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(3, 2 * BLOCK + 77), (9, 131), (1, BLOCK)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprob_and_gradient(dtype, rows, vocab, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    logits[0, 5] = 60.0  # one dominant logit: the online max must rescale what came before it
    logits[-1, -1] = -60.0
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = 5
    upstream = torch.randn(rows, generator=g)
    logits, targets, upstream = logits.to(DEVICE), targets.to(DEVICE), upstream.to(DEVICE)

    logp, entropy, lse = token_logprob_triton(logits, targets, temperature)
    z = logits.double().cpu() / temperature
    logsm = torch.log_softmax(z, -1)
    exact_logp = logsm.gather(-1, targets.cpu()[:, None])[:, 0]
    exact_entropy = -(logsm.exp() * logsm).sum(-1)
    tol = TOLERANCE[dtype]
    assert torch.allclose(logp.double().cpu(), exact_logp, atol=tol * 60, rtol=tol)
    assert torch.allclose(entropy.double().cpu(), exact_entropy, atol=tol * 60, rtol=tol)
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(z, -1), atol=tol * 60, rtol=tol)
    ref = token_logprob_reference(logits, targets, temperature)
    for ours, theirs in zip((logp, entropy, lse), ref):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-5)

    grad = token_logprob_backward_triton_(logits.clone(), targets, lse, upstream, temperature)
    z64 = z.clone().requires_grad_(True)
    (torch.log_softmax(z64, -1).gather(-1, targets.cpu()[:, None])[:, 0] * upstream.double().cpu()).sum().backward()
    exact_grad = z64.grad / temperature
    step = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # the result's own rounding
    # softmax = exp(z - lse) inherits lse's fp32 rounding (relative 6e-8 of |lse|, here up to 86)
    atol = 1e-6 + 4 * 6e-8 * float(lse.abs().max()) * float(upstream.abs().max()) / temperature
    assert grad.dtype == dtype
    assert torch.allclose(grad.double().cpu(), exact_grad, atol=atol, rtol=step)
    assert torch.allclose(grad.double(), token_logprob_backward_reference(logits, targets, lse, upstream,
                                                                          temperature).double(), atol=atol, rtol=step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_with_an_entropy_term(dtype, temperature):
    """d(sum g logp + ge H) / d logits (an entropy bonus trains through the entropy) against float64 autograd,
    from the kernel and from the reference."""
    rows, vocab = 5, BLOCK + 301
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    up_logp, up_ent = torch.randn(rows, generator=g).to(DEVICE), torch.randn(rows, generator=g).to(DEVICE)
    logp, entropy, lse = token_logprob_triton(logits, targets, temperature)
    z64 = (logits.double().cpu() / temperature).requires_grad_(True)
    logsm = torch.log_softmax(z64, -1)
    objective = (logsm.gather(-1, targets.cpu()[:, None])[:, 0] * up_logp.double().cpu()).sum()
    objective = objective + (-(logsm.exp() * logsm).sum(-1) * up_ent.double().cpu()).sum()
    objective.backward()
    exact = z64.grad / temperature
    step = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    atol = 1e-5 + 8 * 6e-8 * float(lse.abs().max()) * 4 / temperature
    kernel = token_logprob_backward_triton_(logits.clone(), targets, lse, up_logp, temperature, entropy, up_ent)
    reference = token_logprob_backward_reference(logits, targets, lse, up_logp, temperature, entropy, up_ent)
    for got in (kernel, reference):
        assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=max(step, 1e-5))
