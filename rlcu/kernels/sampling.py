"""Token sampling with temperature, top-k, top-p and min-p, returning each sampled token's logprob.

The one sampler of rlcu: the reference rollout uses it and the native engine will too. The returned
logprob is log softmax(logits / temperature) at the token, over the full vocabulary: exactly what the
GRPO trainer recomputes, so the two can be compared and the engine's logprobs can stand in for the
"old" policy. Filters follow transformers' order: temperature, top-k, top-p, min-p."""
from __future__ import annotations

import torch


def sample_reference(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] float32). temperature 0 is greedy."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / temperature
    logprobs = torch.log_softmax(scaled, -1)
    filtered = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p; the most likely token always stays
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(filtered, -1)
        filtered = filtered.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    probs = torch.softmax(filtered, -1)
    # Gumbel-max in its exponential form: argmax p / E with E ~ Exp(1) draws from p, and takes a generator.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None):
    return sample_reference(logits, temperature, top_k, top_p, min_p, generator)
