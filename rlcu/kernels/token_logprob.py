"""Log-probability and entropy of one target token per row of logits, and the gradient of that
log-probability with respect to the logits, each in one pass over the row.

The PyTorch form upcasts the [tokens x vocab] logits to fp32 and makes about eight elementwise passes
over them (log-sum-exp, subtract, exp, multiply, sum; the backward as many again). These kernels read
the GEMM's logits in their own dtype once, keep an online max / sum-exp / sum-exp-times-logit in fp32,
and the backward overwrites the recomputed logits with their gradient in place.

`LinearTokenLogprob` is the LM head's autograd Function over these: (logp, entropy) of targets under
softmax(hidden @ weight.T / T), recomputing the logits in backward instead of keeping them; soft-capped logits
(Gemma 2) are capped after the GEMM and their gradient goes back through the cap."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, tl, triton, use_triton
from rlcu.kernels.matmul import invariant_linear

BLOCK = 2048


def _widened(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax statistics in fp32 at least


def token_logprob_reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logp of targets, entropy, log-sum-exp), each [N] in fp32 (fp64 for fp64 logits), of
    softmax(logits / temperature). Two [N x vocab] buffers at most: the scaled logits become the
    log-softmax in place."""
    z = _widened(logits) / temperature  # a new tensor, whatever the input's dtype
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse
    z.sub_(lse[:, None])
    return logp, -(z.exp().mul_(z)).sum(-1), lse


def token_logprob_backward_reference(logits, targets, lse, grad_logp, temperature: float = 1.0, entropy=None,
                                     grad_entropy=None):
    """d(sum g * logp + ge * H) / d logits = [g (onehot(target) - p) - ge p (log p + H)] / temperature, with
    p = softmax(logits / temperature) and H its entropy (the entropy term only when `grad_entropy` is given)."""
    log_p = (_widened(logits) / temperature).sub_(lse[:, None])
    p = log_p.exp()
    g = grad_logp[:, None].to(p.dtype)
    if grad_entropy is not None:
        ge = grad_entropy[:, None].to(p.dtype)
        grad = log_p.add_(entropy[:, None].to(p.dtype)).mul_(p).mul_(-ge).sub_(p * g)
    else:
        grad = p.mul_(-g)
    grad.scatter_add_(1, targets[:, None], g)
    return grad.div_(temperature).to(logits.dtype)


if HAS_TRITON:
    @triton.jit
    def _token_logprob_kernel(LOGITS, TARGETS, LOGP, ENTROPY, LSE, stride_row, vocab, inv_temperature,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride_row
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max, sum exp, sum exp * z
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            mask = start + cols < vocab
            z = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, z)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen only padding: no -inf - -inf
            scale = tl.exp(m - shift)
            e = tl.exp(z - shift)
            s = s * scale + e
            t = t * scale + e * tl.where(mask, z, 0.0)
            m = m_new
        row_max = tl.max(m, 0)
        lane = tl.exp(m - row_max)
        total = tl.sum(s * lane, 0)
        lse = row_max + tl.log(total)
        target = tl.load(TARGETS + row)
        z_target = tl.load(base + target).to(tl.float32) * inv_temperature
        tl.store(LOGP + row, z_target - lse)
        tl.store(ENTROPY + row, lse - tl.sum(t * lane, 0) / total)
        tl.store(LSE + row, lse)

    @triton.jit
    def _token_logprob_backward_kernel(LOGITS, TARGETS, LSE, GRAD, ENTROPY, GRAD_ENTROPY, stride_row, vocab,
                                       inv_temperature, BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride_row
        cols = tl.arange(0, BLOCK)
        lse = tl.load(LSE + row)
        g = tl.load(GRAD + row)
        target = tl.load(TARGETS + row)
        h = 0.0
        ge = 0.0
        if WITH_ENTROPY:
            h = tl.load(ENTROPY + row)
            ge = tl.load(GRAD_ENTROPY + row)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            mask = idx < vocab
            log_p = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse
            p = tl.exp(log_p)
            grad = tl.where(idx == target, g, 0.0) - g * p
            if WITH_ENTROPY:
                grad -= ge * p * (log_p + h)
            tl.store(base + idx, (grad * inv_temperature).to(LOGITS.dtype.element_ty), mask=mask)


def token_logprob_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    n, vocab = logits.shape
    assert logits.stride(-1) == 1
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    _token_logprob_kernel[(n,)](logits, targets, logp, entropy, lse, logits.stride(0), vocab, 1.0 / temperature,
                                BLOCK=BLOCK)
    return logp, entropy, lse


def token_logprob_backward_triton_(logits, targets, lse, grad_logp, temperature: float = 1.0, entropy=None,
                                   grad_entropy=None) -> torch.Tensor:
    """As the reference, written over `logits` (which the caller recomputed and no longer needs)."""
    n, vocab = logits.shape
    assert logits.stride(-1) == 1
    with_entropy = grad_entropy is not None
    ent = entropy.float().contiguous() if with_entropy else lse
    grad_ent = grad_entropy.float().contiguous() if with_entropy else lse
    _token_logprob_backward_kernel[(n,)](logits, targets, lse, grad_logp.float().contiguous(), ent, grad_ent,
                                         logits.stride(0), vocab, 1.0 / temperature, BLOCK=BLOCK,
                                         WITH_ENTROPY=with_entropy)
    return logits


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logp, entropy, lse) of `targets` under softmax(logits / temperature): the Triton kernel where
    `use_triton` says so, the reference elsewhere. The sampler's logprobs in exact mode come from here too."""
    forward = token_logprob_triton if use_triton(logits) else token_logprob_reference
    return forward(logits, targets, temperature)


class LinearTokenLogprob(torch.autograd.Function):
    """(log softmax(hidden @ weight.T / T)[target], entropy) per row, both differentiable (the entropy for
    an entropy bonus; its gradient is computed only when a loss uses it). Triton kernels where `use_triton`
    says so, the references elsewhere (the CPU). `batch_invariant`: the logits from the batch-invariant GEMM
    (`exact_logprobs`), as the engine's LM head computes them. `softcap`: the logits bounded as cap * tanh(z / cap)
    in their own dtype, as the engine's head bounds them (`Linear.softcap`)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, batch_invariant=False, softcap=None):
        device_type = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.fused = use_triton(hidden)
        ctx.linear = invariant_linear if batch_invariant else F.linear
        logits = ctx.linear(hidden, weight)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logps, entropy, lse = token_logprob(logits, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.set_materialize_grads(False)  # an unused entropy brings None, not a row of zeros to multiply
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logps is None:
            grad_logps = torch.zeros_like(lse)
        enabled, dtype = ctx.autocast
        backward = token_logprob_backward_triton_ if ctx.fused else token_logprob_backward_reference
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):  # the forward's matmul precision
            logits = ctx.linear(hidden, weight)
            if ctx.softcap is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2
                tanh = torch.tanh(logits / ctx.softcap)
                logits = tanh * ctx.softcap
            grad = backward(logits, targets, lse, grad_logps, ctx.temperature, entropy, grad_entropy)
            if ctx.softcap is not None:
                grad = grad * (1 - tanh * tanh)
            grad = grad.to(torch.promote_types(hidden.dtype, weight.dtype) if not enabled else dtype)
            grad_hidden = (grad @ weight.to(grad.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (grad.t() @ hidden.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None
