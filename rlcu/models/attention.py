"""How a layer's attention sees its keys. The model computes q, k, v and hands them to one of these;
training uses `PaddedAttention`, the reference rollout `DenseCacheAttention`, and the engine its paged
attention, all on the same modules and parameters."""
from __future__ import annotations

import functools
import inspect
from typing import Protocol

import torch

from rlcu.kernels._triton import use_triton
from rlcu.kernels.rope import rope
from rlcu.kernels.rope_store_kv import supported as rope_kernel_supported
from rlcu.kernels.sdpa import sdpa as sdpa_heads_first
from rlcu.kernels.varlen_attention import varlen_attention, varlen_tiles
from rlcu.models.linear_attention import Segments, rows_as_sequences


class AttentionContext(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D], before RoPE; cos/sin: [B, T, 1, R] -> [B, T, Hq, D], where
        R <= D dims of each head rotate (R < D: partial RoPE, the rest pass through; `rlcu/kernels/rope.py`).
        `scale` multiplies q.k; `window`: a query sees only the last `window` keys up to itself (None: all).
        The context applies RoPE, so that the engine can fuse it with its KV-cache write. A context whose
        `applies_qk_norm` is true also receives the layer's q/k RMSNorm modules (Qwen3) as the keyword
        `qk_norm=(q_norm, k_norm)`, with q and k unnormalised. `batch_invariant` (an attribute): the forward's
        linear layers run batch-invariant GEMMs too (`Numerics.EXACT`). A layer with attention sinks (gpt-oss)
        passes them as the keyword `sinks` ([Hq]), one with soft-capped scores (Gemma 2) its cap as `softcap`
        (both `rlcu/kernels/sdpa.py`)."""

    def segments(self, layer_idx: int, batch: int, length: int, device) -> Segments:
        """For a hybrid's linear-attention layer: how the [B, T] tokens split into sequences and the state each
        brings (`rlcu/models/linear_attention.py`)."""

    def keep(self, layer_idx: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """The layer's state after these tokens, per sequence: kept where later tokens continue from it."""

    # Optional: `record_routing(moe_index, experts)`, a context that keeps which experts each of its tokens went
    # to ([T, k] per MoE layer); training's contexts have none.


def fuses_qk_norm(cfg, like: torch.Tensor) -> bool:
    """Whether a context takes a layer's per-head q/k norms into the RoPE + KV-write kernel (`rope_store_kv.py`)
    when its tensors are on `like`'s device: the engine's attention does wherever that kernel runs in Triton, and
    exact mode's training attention decides by this same rule, so both sides compute the normed q and k alike."""
    return bool(cfg.qk_norm) and cfg.spec.qk_norm != "full" and use_triton(like) and rope_kernel_supported(cfg.head_dim)


def qk_norm_operands(q: torch.Tensor, k: torch.Tensor, qk_norm) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(q, k, the RoPE + KV-write kernel's norm arguments) for the norm modules `qk_norm` = (q_norm, k_norm). The
    kernel rounds the normed q and k once, to q's dtype, which is what the modules give where the weight is in q's
    dtype or the norm is Gemma's 1 + w; under autocast with wider weights the modules run here instead, and the
    kernel gets no norm. Both the engine and exact mode's training attention decide by this rule."""
    q_norm, k_norm = qk_norm
    if q_norm.weight.dtype == q.dtype or q_norm.offset:
        return q, k, (q_norm.operand(), k_norm.operand(), q_norm.eps, q_norm.offset)
    return q_norm(q), k_norm(k), ()


class Stateless:
    """Training's contexts: every sequence starts from zero state and nothing is kept."""

    def keep(self, layer_idx, conv, state) -> None:
        pass


def causal_key_mask(key_valid: torch.Tensor, num_queries: int, window: int | None = None) -> torch.Tensor:
    """[B, S] key validity -> [B, 1, T, S] boolean mask for the last T positions of S.

    A query may see valid keys at or before its own position (and, with a window, fewer than `window` before
    it: real tokens are contiguous in a row, so columns count positions). It always sees itself, so that
    padding queries have a non-empty row (SDPA turns an empty row into NaN, which would poison gradients)."""
    s = key_valid.shape[1]
    q_pos = torch.arange(s - num_queries, s, device=key_valid.device)[:, None]
    k_pos = torch.arange(s, device=key_valid.device)[None, :]
    causal = (k_pos <= q_pos) if window is None else (k_pos <= q_pos) & (q_pos - k_pos < window)
    mask = causal[None] & key_valid[:, None, :]
    mask |= (k_pos == q_pos)[None]
    return mask[:, None]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]."""
    if mask is not None and k.shape[2] != q.shape[2] and sinks is None and softcap is None:
        # with a mask, SDPA's GQA support falls back to the math kernel, which keeps [B, H, T, T]
        # probabilities for backward; repeated K/V heads take the memory-efficient kernel instead
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    return sdpa_heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale,
                            sinks, softcap).transpose(1, 2)


def capped_or_sinks_kernel(q: torch.Tensor, sinks, softcap) -> bool:
    """Whether a layer with soft-capped scores or sinks attends through `varlen_attention` (forward and backward in
    Triton) rather than `sdpa`'s PyTorch form: on CUDA in 16 bits, where flash attention would run without them."""
    return (sinks is not None or softcap is not None) and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


class PaddedAttention(Stateless):
    """Self-attention over a padded batch (prompt left-padded, completion right-padded)."""

    batch_invariant = False

    def __init__(self, attention_mask: torch.Tensor | None):
        # no padding at all (equal lengths): plain causal attention, which takes the flash kernel
        unpadded = attention_mask is None or bool(attention_mask.all())
        self.attention_mask = None if unpadded else attention_mask.bool()
        self.masks: dict[int | None, torch.Tensor | None] = {}
        self.tiles: torch.Tensor | None = None  # varlen_attention's work list, made once a forward

    def row_tiles(self, batch: int, length: int, device) -> torch.Tensor:
        """Each row's tokens as a sequence of the flattened [B * T] rows: a row's tokens lie between its padding."""
        if self.tiles is None:
            base = torch.arange(batch) * length
            if self.attention_mask is None:
                self.tiles = varlen_tiles(base, base + length, device)
            else:
                valid = self.attention_mask.int()
                first, after = valid.argmax(1).cpu(), length - valid.flip(1).argmax(1).cpu()
                self.tiles = varlen_tiles(base + first, base + after, device)
        return self.tiles

    def segments(self, layer_idx, batch, length, device) -> Segments:
        return rows_as_sequences(batch, length, device, self.attention_mask)

    def __call__(self, layer_idx, q, k, v, cos, sin, scale=None, window=None, sinks=None, softcap=None):
        t = q.shape[1]
        if window is not None and window >= t:
            window = None  # every key is inside the window
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if capped_or_sinks_kernel(q, sinks, softcap):
            b = q.shape[0]
            out = varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), self.row_tiles(b, t, q.device),
                                   scale, window, sinks, softcap)
            return out.view(q.shape)  # a padding row's output 0 where sdpa's sees the keys before it: never read
        if window not in self.masks:
            valid = self.attention_mask
            if valid is None and window is not None:
                valid = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
            self.masks[window] = None if valid is None else causal_key_mask(valid, t, window)
        return sdpa(q, k, v, self.masks[window], scale, sinks, softcap)


class PackedAttention(Stateless):
    """Padding-free training: the batch's sequences one after another in a single row ([1, T]), each
    attending causally within itself. `cu_seqlens` [n + 1] (int32) marks where each starts. On CUDA in
    bf16/fp16 this is variable-length flash attention (`torch.nn.attention.varlen`, forward and
    backward), or with soft-capping or sinks `varlen_attention`; elsewhere SDPA with a block-diagonal causal mask
    (the CPU and fp32 path). Sequences all of one length (and no window) are a batch: causal SDPA."""

    batch_invariant = False

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int):
        self.cu, self.max_len = cu_seqlens.to(torch.int32), max_len
        self.masks: dict[int | None, torch.Tensor] = {}
        self.tiles: torch.Tensor | None = None  # varlen_attention's work list, made once a forward

    def segments(self, layer_idx, batch, length, device) -> Segments:
        return Segments(self.cu)

    def __call__(self, layer_idx, q, k, v, cos, sin, scale=None, window=None, sinks=None, softcap=None):
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if window is not None and window >= self.max_len:
            window = None
        n, t = self.cu.numel() - 1, q.shape[1]
        if t == n * self.max_len and window is None and sinks is None and softcap is None:
            # every sequence max_len long: the row is a batch, and SDPA's causal kernels (cuDNN's on Hopper, as
            # the padded batch takes them) beat the variable-length ones
            return sdpa(*(x.view(n, self.max_len, *x.shape[2:]) for x in (q, k, v)), None, scale).view(q.shape)
        varlen = _varlen()
        if (sinks is None and softcap is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                and varlen is not None and (window is None or varlen.windows)):
            return varlen(q[0], k[0], v[0], self.cu, self.max_len, scale, window)[None]
        if capped_or_sinks_kernel(q, sinks, softcap):
            if self.tiles is None:
                cu = self.cu.cpu()
                self.tiles = varlen_tiles(cu[:-1], cu[1:], q.device)
            return varlen_attention(q[0], k[0], v[0], self.tiles, scale, window, sinks, softcap)[None]
        if window not in self.masks:
            t = q.shape[1]
            segment = torch.repeat_interleave(torch.arange(len(self.cu) - 1, device=q.device),
                                              (self.cu[1:] - self.cu[:-1]).long(), output_size=t)
            pos = torch.arange(t, device=q.device)
            mask = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
            if window is not None:
                mask &= pos[:, None] - pos[None, :] < window
            self.masks[window] = mask[None, None]
        return sdpa(q, k, v, self.masks[window], scale, sinks, softcap)


@functools.cache
def _varlen():
    """torch's variable-length flash attention as f(q, k, v, cu_seqlens, max_len, scale, window) (causal, GQA),
    or None where this torch has none; `.windows` says whether it takes a sliding window. Its keywords
    changed between releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    windows = "window_size" in params
    causal = {} if windows else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def attend(q, k, v, cu, max_len, scale=None, window=None):
        if not gqa and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        extra = {}
        if scale is not None and "scale" in params:
            extra["scale"] = scale
        elif scale is not None:  # a release without the keyword: its default scale, q rescaled to ours
            q = q * (scale * q.shape[-1] ** 0.5)
        if windows:
            extra["window_size"] = (-1 if window is None else window - 1, 0)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal, **gqa, **extra)

    attend.windows = windows
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
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # linear-attention layer -> (conv, matrix)

    def step(self, new_valid: torch.Tensor) -> "DenseCacheAttention":
        """Reserve the next T slots ([B, T] validity) and return the attention context for them."""
        start, t = self.length, new_valid.shape[1]
        if start + t > self.key_valid.shape[1]:
            raise ValueError(f"dense KV cache overflow: {start + t} > {self.key_valid.shape[1]} slots")
        self.key_valid[:, start:start + t] = new_valid
        self.length = start + t
        return DenseCacheAttention(self, start, t)


class DenseCacheAttention:
    batch_invariant = False

    def __init__(self, cache: DenseKVCache, start: int, t: int):
        self.cache, self.start, self.end, self.t = cache, start, start + t, t
        self.masks = {None: causal_key_mask(cache.key_valid[:, :self.end], t)}

    def segments(self, layer_idx, batch, length, device) -> Segments:
        """Each row one sequence, continuing from its state after the earlier steps; padding zeroed."""
        seg = rows_as_sequences(batch, length, device, self.cache.key_valid[:, self.start:self.end])
        seg.conv, seg.state = self.cache.states.get(layer_idx, (None, None))
        seg.decode = length == 1
        return seg

    def keep(self, layer_idx, conv, state) -> None:
        self.cache.states[layer_idx] = (conv, state)

    def __call__(self, layer_idx, q, k, v, cos, sin, scale=None, window=None, sinks=None, softcap=None):
        c = self.cache
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        c.k[layer_idx][:, self.start:self.end] = k
        c.v[layer_idx][:, self.start:self.end] = v
        if window not in self.masks:
            self.masks[window] = causal_key_mask(c.key_valid[:, :self.end], self.t, window)
        return sdpa(q, c.k[layer_idx][:, :self.end], c.v[layer_idx][:, :self.end], self.masks[window], scale, sinks,
                    softcap)
