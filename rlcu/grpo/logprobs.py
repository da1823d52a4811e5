"""Per-token log-probabilities and entropies of completion tokens, computed over the LM head in chunks
of rows, so the [tokens x vocab] logits never exist at once. Each chunk keeps only its inputs and
its log-sum-exp for backward, which recomputes the chunk's logits and forms the gradient
d logp / d logits = onehot(target) - softmax in place: one [rows x vocab] buffer at a time."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import use_triton
from rlcu.kernels.token_logprob import token_logprob_backward_triton_, token_logprob_triton

CHUNK_BYTES = 512 * 2**20  # logits per chunk: small enough to fit beside training, big enough for full GEMMs


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    if logits.dtype in (torch.float16, torch.bfloat16):  # softmax statistics in fp32 at least
        logits = logits.float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _LinearLogprob(torch.autograd.Function):
    """(log softmax(hidden @ weight.T / T)[target], entropy) per row; the entropy is a metric, never trained on.
    On CUDA the softmax statistics and the logits' gradient are one Triton pass each over the GEMM's
    logits in their own dtype (`rlcu/kernels/token_logprob.py`); elsewhere the PyTorch form in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        device_type = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.fused = use_triton(hidden)
        if ctx.fused:
            logps, entropy, lse = token_logprob_triton(F.linear(hidden, weight), targets, temperature)
        else:
            logits = _scaled_logits(hidden, weight, temperature)
            lse = torch.logsumexp(logits, -1)
            logps = logits.gather(-1, targets[:, None])[:, 0] - lse
            logits.sub_(lse[:, None])  # now log softmax
            plogp = logits.exp().mul_(logits)
            entropy = -plogp.sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):  # the forward's matmul precision
            if ctx.fused:
                grad = token_logprob_backward_triton_(F.linear(hidden, weight), targets, lse, grad_logps,
                                                      ctx.temperature)
            else:
                grad = _scaled_logits(hidden, weight, ctx.temperature).sub_(lse[:, None]).exp_()  # softmax
                grad.mul_(-grad_logps[:, None]).scatter_add_(1, targets[:, None], grad_logps[:, None].to(grad.dtype))
                if ctx.temperature != 1.0:
                    grad.div_(ctx.temperature)
            grad = grad.to(torch.promote_types(hidden.dtype, weight.dtype) if not enabled else dtype)
            grad_hidden = (grad @ weight.to(grad.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (grad.t() @ hidden.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, entropy), each [N], of `targets` [N] under softmax(hidden [N, H] @ weight.T / temperature)."""
    if chunk_tokens is None:  # the fused path keeps logits in the GEMM's dtype, the PyTorch one in fp32
        itemsize = weight.element_size() if use_triton(hidden) else 4
        chunk_tokens = max(64, CHUNK_BYTES // (itemsize * weight.shape[0]))
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = _LinearLogprob.apply(hidden[s:s + chunk_tokens], weight, targets[s:s + chunk_tokens], temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, num_completion_tokens: int,
                        temperature: float = 1.0, chunk_tokens: int | None = None,
                        packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, entropy), each [B, C]: log softmax(logits / temperature) of the last C tokens of each row,
    given everything before them. Dividing by the sampling temperature makes these comparable with the
    sampler's logprobs (TRL does the same). `packed`: the rows' real tokens run as one padding-free
    sequence, and only real completion tokens go through the LM head (the padded slots are 0)."""
    c = num_completion_tokens
    if packed:
        return _packed_completion_logprobs(model, input_ids, attention_mask, c, temperature, chunk_tokens)
    hidden = model.forward_padded(input_ids, attention_mask)[:, -c - 1:-1]
    b, _, h = hidden.shape
    logps, ents = linear_logprobs(hidden.reshape(b * c, h), model.lm_head.weight, input_ids[:, -c:].reshape(b * c),
                                  temperature, chunk_tokens)
    return logps.view(b, c), ents.view(b, c)


def _packed_completion_logprobs(model, input_ids, attention_mask, c, temperature, chunk_tokens):
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    cu = F.pad(lengths.cumsum(0), (1, 0))
    flat = input_ids[mask]  # row by row, so each row's tokens stay together and in order
    offset = mask.long().cumsum(1) - 1  # a real token's position within its row
    hidden = model.forward_packed(flat[None], offset[mask][None], cu, int(lengths.max()))[0]
    real = mask[:, -c:]  # the completion slots that hold a token
    target = (cu[:-1, None] + offset[:, -c:])[real]  # where each completion token sits in the packed row
    logps, ents = linear_logprobs(hidden[target - 1], model.lm_head.weight, flat[target], temperature, chunk_tokens)
    zeros = logps.new_zeros(real.shape)
    return zeros.masked_scatter(real, logps), zeros.masked_scatter(real, ents)
