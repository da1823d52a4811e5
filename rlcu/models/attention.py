"""How a layer's attention sees its keys. The model computes q, k, v and hands them to one of these;
training uses `PaddedAttention`, the reference rollout `DenseCacheAttention`, and the engine its paged
attention, all on the same modules and parameters."""
from __future__ import annotations

import functools
import inspect
from typing import Protocol

import torch
import torch.nn.functional as F

from rlcu.kernels.rope import rope


class AttentionContext(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D], before RoPE; cos/sin: [B, T, 1, D] -> [B, T, Hq, D].
        The context applies RoPE, so that the engine can fuse it with its KV-cache write. A context whose
        `applies_qk_norm` is true also receives the layer's q/k RMSNorm modules (Qwen3) as the keyword
        `qk_norm=(q_norm, k_norm)`, with q and k unnormalised."""


def causal_key_mask(key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """[B, S] key validity -> [B, 1, T, S] boolean mask for the last T positions of S.

    A query may see valid keys at or before its own position. It always sees itself, so that padding
    queries have a non-empty row (SDPA turns an empty row into NaN, which would poison gradients)."""
    s = key_valid.shape[1]
    q_pos = torch.arange(s - num_queries, s, device=key_valid.device)[:, None]
    k_pos = torch.arange(s, device=key_valid.device)[None, :]
    causal = k_pos <= q_pos
    mask = causal[None] & key_valid[:, None, :]
    mask |= (k_pos == q_pos)[None]
    return mask[:, None]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None and k.shape[2] != q.shape[2]:
        # with a mask, SDPA's GQA support falls back to the math kernel, which keeps [B, H, T, T]
        # probabilities for backward; repeated K/V heads take the memory-efficient kernel instead
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None, enable_gqa=mask is None)
    return out.transpose(1, 2)


class PaddedAttention:
    """Self-attention over a padded batch (prompt left-padded, completion right-padded)."""

    def __init__(self, attention_mask: torch.Tensor | None):
        # no padding at all (equal lengths): plain causal attention, which takes the flash kernel
        unpadded = attention_mask is None or bool(attention_mask.all())
        self.mask = None if unpadded else causal_key_mask(attention_mask.bool(), attention_mask.shape[1])

    def __call__(self, layer_idx, q, k, v, cos, sin):
        return sdpa(rope(q, cos, sin), rope(k, cos, sin), v, self.mask)


class PackedAttention:
    """Padding-free training: the batch's sequences one after another in a single row ([1, T]), each
    attending causally within itself. `cu_seqlens` [n + 1] (int32) marks where each starts. On CUDA in
    bf16/fp16 this is variable-length flash attention (`torch.nn.attention.varlen`, forward and
    backward); elsewhere SDPA with a block-diagonal causal mask (the CPU and fp32 path)."""

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int):
        self.cu, self.max_len = cu_seqlens.to(torch.int32), max_len
        self._mask = None

    def __call__(self, layer_idx, q, k, v, cos, sin):
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen() is not None:
            return _varlen()(q[0], k[0], v[0], self.cu, self.max_len)[None]
        if self._mask is None:
            t = q.shape[1]
            segment = torch.repeat_interleave(torch.arange(len(self.cu) - 1, device=q.device),
                                              (self.cu[1:] - self.cu[:-1]).long(), output_size=t)
            pos = torch.arange(t, device=q.device)
            self._mask = ((segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]
        return sdpa(q, k, v, self._mask)


@functools.cache
def _varlen():
    """torch's variable-length flash attention as f(q, k, v, cu_seqlens, max_len) (causal, GQA), or None
    where this torch has none. Its keyword for causality changed between releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def attend(q, k, v, cu, max_len):
        if not gqa and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal, **gqa)

    return attend


class DenseKVCache:
    """A contiguous per-layer KV cache for a left-padded batch that advances in lockstep."""

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0

    def step(self, new_valid: torch.Tensor) -> "DenseCacheAttention":
        """Reserve the next T slots ([B, T] validity) and return the attention context for them."""
        start, t = self.length, new_valid.shape[1]
        if start + t > self.key_valid.shape[1]:
            raise ValueError(f"dense KV cache overflow: {start + t} > {self.key_valid.shape[1]} slots")
        self.key_valid[:, start:start + t] = new_valid
        self.length = start + t
        return DenseCacheAttention(self, start, t)


class DenseCacheAttention:
    def __init__(self, cache: DenseKVCache, start: int, t: int):
        self.cache, self.start, self.end = cache, start, start + t
        self.mask = causal_key_mask(cache.key_valid[:, :self.end], t)

    def __call__(self, layer_idx, q, k, v, cos, sin):
        c = self.cache
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        c.k[layer_idx][:, self.start:self.end] = k
        c.v[layer_idx][:, self.start:self.end] = v
        return sdpa(q, c.k[layer_idx][:, :self.end], c.v[layer_idx][:, :self.end], self.mask)
