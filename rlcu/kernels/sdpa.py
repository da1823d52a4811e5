"""Scaled dot-product attention in PyTorch, with attention sinks (gpt-oss) and soft-capped scores (Gemma 2) where a
model has them: the form the kernels' references and training's contexts share.

A sink is a learned logit per query head, a virtual key with a zero value that every query sees: softmax over
[q.k * scale..., sink], its share dropped. Rows then sum to less than 1, so a head can attend to nothing. The
engine's Triton kernels fold it in as the first entry of their online softmax (m = sink, l = 1).

Soft-capping bounds each score as `cap * tanh(score / cap)`, after the scale and before the mask, as transformers'
eager attention computes it; flash and SDPA kernels have no such step, so such a layer attends here."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
         sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D] (GQA: Hkv divides Hq); `mask` [B or 1, 1 or Hq, T, S] boolean (True:
    seen) or None (causal, the T queries being the last T of the S positions); `sinks` [Hq] or None; `softcap`:
    the scores' cap, or None."""
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    t, s = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
