"""Per-token log-probabilities and entropies of completion tokens, computed over the LM head in chunks
of rows, so the [tokens x vocab] logits never exist at once. Each chunk keeps only its inputs and
its log-sum-exp for backward, which recomputes the chunk's logits and forms the gradient
d logp / d logits = onehot(target) - softmax in place (`rlcu/kernels/token_logprob.py`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcu.contracts import Numerics
from rlcu.kernels._triton import use_triton
from rlcu.kernels.token_logprob import LinearTokenLogprob

CHUNK_BYTES = 512 * 2**20  # logits per chunk: small enough to fit beside training, big enough for full GEMMs


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_tokens: int | None = None,
                    batch_invariant: bool = False, fp32: bool = False,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, entropy), each [N], of `targets` [N] under softmax(hidden [N, H] @ weight.T / temperature).
    `batch_invariant`: the logits from the batch-invariant GEMM (`exact_logprobs`). `fp32`: the GEMM in float32
    outside autocast, as the engine's head computes it under `cast_lm_head_to_fp32` (`Linear.fp32`). `softcap`:
    the logits soft-capped first (`Linear.softcap`, Gemma 2)."""
    if fp32:
        with torch.autocast(hidden.device.type, enabled=False):
            return linear_logprobs(hidden.float(), weight.float(), targets, temperature, chunk_tokens, batch_invariant,
                                   softcap=softcap)
    if chunk_tokens is None:  # the fused path keeps logits in the GEMM's dtype, the PyTorch one in fp32
        itemsize = weight.element_size() if use_triton(hidden) else 4
        chunk_tokens = max(64, CHUNK_BYTES // (itemsize * weight.shape[0]))
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = LinearTokenLogprob.apply(hidden[s:s + chunk_tokens], weight, targets[s:s + chunk_tokens], temperature,
                                           batch_invariant, softcap)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, num_completion_tokens: int,
                        temperature: float = 1.0, chunk_tokens: int | None = None, packed: bool = False,
                        numerics: Numerics = Numerics.FAST) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, entropy), each [B, C]: log softmax(logits / temperature) of the last C tokens of each row,
    given everything before them. Dividing by the sampling temperature makes these comparable with the
    sampler's logprobs (TRL does the same). `packed`: the rows' real tokens run as one padding-free
    sequence, and only real completion tokens go through the LM head (the padded slots are 0). EXACT numerics
    (`exact_logprobs`) always run packed, through the engine's own attention kernel and GEMMs."""
    c = num_completion_tokens
    if model.logits_from_forward:  # the transformers fallback: its own forward's logits, whatever follows its head
        return _forward_completion_logprobs(model, input_ids, attention_mask, c, temperature)
    if packed or numerics.batch_invariant:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return _packed_completion_logprobs(model, input_ids, attention_mask, c, temperature, chunk_tokens, numerics)
    hidden = model.forward_padded(input_ids, attention_mask)[:, -c - 1:-1]
    b, _, h = hidden.shape
    head = model.lm_head
    logps, ents = linear_logprobs(hidden.reshape(b * c, h), head.full_weight(), input_ids[:, -c:].reshape(b * c),
                                  temperature, chunk_tokens, fp32=head.fp32, softcap=head.softcap)
    return logps.view(b, c), ents.view(b, c)


def _packed_completion_logprobs(model, input_ids, attention_mask, c, temperature, chunk_tokens, numerics):
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    cu = F.pad(lengths.cumsum(0), (1, 0))
    flat = input_ids[mask]  # row by row, so each row's tokens stay together and in order
    offset = mask.long().cumsum(1) - 1  # a real token's position within its row
    hidden = model.forward_packed(flat[None], offset[mask][None], cu, int(lengths.max()), numerics)[0]
    real = mask[:, -c:]  # the completion slots that hold a token
    target = (cu[:-1, None] + offset[:, -c:])[real]  # where each completion token sits in the packed row
    head = model.lm_head
    logps, ents = linear_logprobs(hidden[target - 1], head.full_weight(), flat[target], temperature, chunk_tokens,
                                  numerics.batch_invariant, head.fp32, head.softcap)
    zeros = logps.new_zeros(real.shape)
    return zeros.masked_scatter(real, logps), zeros.masked_scatter(real, ents)


def _forward_completion_logprobs(model, input_ids, attention_mask, c, temperature):
    logits = model.logits(input_ids, attention_mask, keep=c + 1)[:, :-1].float() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, input_ids[:, -c:, None])[..., 0], -(logp.exp() * logp).sum(-1)
