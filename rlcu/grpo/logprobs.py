"""Per-token log-probabilities and entropies of completion tokens, computed in chunks over the LM head
so the [tokens x vocab] fp32 logits never exist at once (each chunk is recomputed in backward)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = F.linear(hidden, weight)
    if logits.dtype in (torch.float16, torch.bfloat16):  # softmax statistics in fp32 at least
        logits = logits.float()
    logits = logits / temperature
    lse = torch.logsumexp(logits, -1)
    logps = logits.gather(-1, targets[:, None])[:, 0] - lse
    with torch.no_grad():  # entropy is a metric, never trained on
        entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logps, entropy


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                        temperature: float = 1.0, chunk_tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, entropy), each [B, C]: log softmax(logits / temperature) of the last C tokens of each row,
    given everything before them. Dividing by the sampling temperature makes these comparable with the
    sampler's logprobs (TRL does the same)."""
    c = num_completion_tokens
    hidden = model.forward_padded(input_ids, attention_mask)[:, -c - 1:-1]
    b, _, h = hidden.shape
    flat, targets = hidden.reshape(b * c, h), input_ids[:, -c:].reshape(b * c)
    weight = model.lm_head.weight
    logps, ents = [], []
    for s in range(0, b * c, chunk_tokens):
        args = (flat[s:s + chunk_tokens], weight, targets[s:s + chunk_tokens], temperature)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps).view(b, c), torch.cat(ents).view(b, c)
