"""Training attention that computes as the engine does (`exact_logprobs`, docs/engine.md).

Each packed sequence's keys and values go, RoPE'd, into a paged buffer through the engine's KV-write
kernel, and its queries attend through the engine's paged attention kernel. That kernel walks the keys
in fixed tiles from position 0 for every query, so a query's sums are the same whether it comes in a
prefill chunk, a decode step or a training forward: the logprobs match the sampler's to the bit.

Per-head q/k norms (Qwen3, Gemma 3) go into the KV-write kernel with RoPE where the engine puts them there
(`fuses_qk_norm`, `qk_norm_operands`): the same kernel on both sides, and two launches a layer fewer at every
decode step than running them as modules.

The backward recomputes the attention with PyTorch (the norms, then `PackedAttention`: RoPE, then
variable-length flash attention or SDPA) and differentiates that: gradients need the math, not the bits. For the
same reason a checkpointed layer's recompute (`rlcu.kernels._recompute`) computes its output that way too, without
the paged buffer: only the backward reads it."""
from __future__ import annotations

import torch

from rlcu.kernels._recompute import recomputing
from rlcu.kernels.prefill_attention import BLOCK_M, paged_attention, query_tiles
from rlcu.kernels.rmsnorm import rms_norm
from rlcu.kernels.rope_store_kv import rope_store_kv
from rlcu.models.attention import PackedAttention, Stateless, qk_norm_operands
from rlcu.models.linear_attention import Segments

BLOCK = 16  # positions per block of the training buffer: only the addressing depends on it, never the sums


class ExactPackedAttention(Stateless):
    """The packed batch (`cu_seqlens` [n + 1]) laid out as paged sequences, each starting on a block.
    `applies_qk_norm`: `fuses_qk_norm` of the model, as the engine decides it."""

    batch_invariant = True

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int, cache_dtype: torch.dtype, applies_qk_norm: bool):
        self.applies_qk_norm = applies_qk_norm
        cu = cu_seqlens.tolist()  # the host needs it for the query tiles anyway
        dev = cu_seqlens.device
        host_lengths = [b - a for a, b in zip(cu, cu[1:])]
        lengths = torch.tensor(host_lengths, device=dev)
        blocks = (lengths + BLOCK - 1) // BLOCK
        first = blocks.cumsum(0) - blocks  # each sequence's first block
        self.num_blocks, self.cache_dtype = sum(-(-n // BLOCK) for n in host_lengths), cache_dtype
        self.cu, self.context_lens = cu_seqlens.to(torch.int32), lengths.to(torch.int32)
        j = torch.arange(max(-(-max_len // BLOCK), 1), device=dev)
        self.tables = torch.where(j < blocks[:, None], first[:, None] + j, 0).to(torch.int32)
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths, output_size=cu[-1])
        self.slots = first[seq] * BLOCK + torch.arange(cu[-1], device=dev) - cu_seqlens[seq]
        self.tiles = query_tiles(cu, BLOCK_M, dev)
        self.reference = PackedAttention(cu_seqlens, max_len)

    def segments(self, layer_idx, batch, length, device) -> Segments:
        return Segments(self.cu)

    def __call__(self, layer_idx, q, k, v, cos, sin, scale=None, window=None, qk_norm=None, sinks=None,
                 softcap=None):
        q, k, norm = qk_norm_operands(q, k, qk_norm) if qk_norm is not None else (q, k, ())
        q_weight, k_weight, eps, offset = norm or (None, None, 0.0, 0.0)
        return _ExactAttention.apply(q, k, v, cos, sin, sinks, q_weight, k_weight, self, layer_idx, scale, window,
                                     softcap, eps, offset)


class _ExactAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cos, sin, sinks, q_weight, k_weight, plan: ExactPackedAttention, layer_idx: int, scale,
                window, softcap, eps, offset):
        """q: [1, T, Hq, D], k/v: [1, T, Hkv, D] before RoPE (and before the per-head norms of `q_weight`,
        `k_weight` [D], when given); cos/sin: [1, T, 1, R] (R < D: partial RoPE); sinks [Hq] or None
        -> [1, T, Hq, D]."""
        _, _, hkv, d = k.shape
        ctx.save_for_backward(q, k, v, cos, sin, sinks, q_weight, k_weight)
        ctx.plan, ctx.layer_idx, ctx.window, ctx.softcap = plan, layer_idx, window, softcap
        ctx.eps, ctx.offset, ctx.scale = eps, offset, d ** -0.5 if scale is None else scale
        if recomputing():  # only the backward reads these values
            return _reference(ctx, q, k, v, cos, sin, sinks, q_weight, k_weight)
        cache = torch.zeros(2, plan.num_blocks, BLOCK, hkv, d, dtype=plan.cache_dtype, device=q.device)
        norm = () if q_weight is None else (q_weight, k_weight, eps, offset)
        roped = rope_store_kv(q[0], k[0], v[0], cos[0, :, 0], sin[0, :, 0], cache[0], cache[1], plan.slots, *norm)
        out = paged_attention(roped, cache[0], cache[1], plan.cu, plan.context_lens, plan.tables, ctx.scale,
                              plan.tiles, window=window, sinks=sinks, softcap=softcap)
        return out[None]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cos, sin, sinks, q_weight, k_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        inputs = [t.detach().requires_grad_(needs[i]) if t is not None else None
                  for i, t in zip((0, 1, 2, 5, 6, 7), (q, k, v, sinks, q_weight, k_weight))]
        with torch.enable_grad():
            q, k, v, sinks, q_weight, k_weight = inputs
            out = _reference(ctx, q, k, v, cos, sin, sinks, q_weight, k_weight)
            wanted = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype)))
        dq, dk, dv, dsinks, dqw, dkw = (next(grads) if t is not None and t.requires_grad else None for t in inputs)
        return dq, dk, dv, None, None, dsinks, dqw, dkw, None, None, None, None, None, None, None


def _reference(ctx, q, k, v, cos, sin, sinks, q_weight, k_weight) -> torch.Tensor:
    """The attention in PyTorch: the norms, then `PackedAttention` (the math of the paged kernel, not its bits)."""
    if q_weight is not None:
        q, k = (rms_norm(x, w, ctx.eps, offset=ctx.offset) for x, w in ((q, q_weight), (k, k_weight)))
    return ctx.plan.reference(ctx.layer_idx, q, k, v, cos, sin, ctx.scale, ctx.window, sinks=sinks,
                              softcap=ctx.softcap)
