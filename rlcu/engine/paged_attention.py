"""The engine's attention context: each layer writes this step's K/V into the paged cache (RoPE, and
Qwen3's q/k norms, fused into that write), then attends over the cache with the decode, shared-prefix
or prefill kernel."""
from __future__ import annotations

import torch

from rlcu.kernels.decode_attention import decode_attention
from rlcu.kernels.kv_cache import FP8
from rlcu.kernels.prefill_attention import paged_attention
from rlcu.kernels.rope_store_kv import rope_store_kv
from rlcu.kernels.shared_prefix_decode import shared_prefix_decode_triton
from rlcu.models.attention import qk_norm_operands
from rlcu.models.decoder import CausalLM
from rlcu.models.linear_attention import Segments

# EngineConfig.kv_cache_dtype, with vLLM's names: "auto" stores keys and values as the forward computes them
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def cache_dtype(model: CausalLM, kv_cache_dtype: str = "auto") -> torch.dtype:
    """The pool's dtype: the forward's (the autocast dtype under mixed precision) for "auto"; e4m3 for "fp8",
    half the bytes of bf16 for every decode step to read, at a logprob cost (docs/engine.md)."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model.compute_dtype()


class PagedAttention:
    """The attention context of one step: write this step's K/V into the cache, then attend over it."""

    def __init__(self, runner, slots, cu_seqlens_q, context_lens, block_tables, decode_only: bool,
                 num_splits: int | None = None, tiles=None, groups=None, prefix_splits: int | None = None,
                 states=None):
        """`runner`: the ModelRunner whose pool this reads. `groups`: (order, starts, shared, skip) of
        `prefix_groups` on the device, for shared-prefix decode. `states`: (cu, slots, fresh, decode) of
        `ModelRunner.state_rows`, for a hybrid's linear-attention layers."""
        self.runner, self.slots, self.cu = runner, slots, cu_seqlens_q
        self.ctx, self.tables = context_lens, block_tables
        self.decode_only, self.num_splits, self.tiles, self.groups = decode_only, num_splits, tiles, groups
        self.prefix_splits, self.states = prefix_splits, states
        self.exact_decode = False  # exact numerics' decode step: one query a sequence, through the prefill kernel
        self.applies_qk_norm = runner.fuse_qk_norm  # Qwen3's q/k norms in the RoPE + KV-write kernel
        self.batch_invariant = runner.exact
        routing = runner.routing
        if routing is not None:
            rows = routing.rows(slots)
            self.record_routing = lambda moe_index, experts: routing.write(moe_index, rows, experts)

    @classmethod
    def decode(cls, runner, slots, context_lens, block_tables, exact_rows=None, num_splits: int | None = None,
               groups=None, prefix_splits: int | None = None, states=None) -> "PagedAttention":
        """A decode step's context (one new token a sequence), for the eager and the CUDA-graph paths alike. In
        exact numerics every row is a sequence of one query through the prefill kernel, the training forward's
        sums: `exact_rows` = (cu_seqlens [n + 1], its query tiles), made here when not given. Otherwise the
        decode kernel, with its KV splits and shared-prefix `groups`."""
        if runner.exact:
            cu, tiles = exact_rows if exact_rows is not None else decode_rows(len(context_lens), context_lens.device)
            step = cls(runner, slots, cu, context_lens, block_tables, decode_only=False, tiles=tiles, states=states)
            step.exact_decode = True
            return step
        return cls(runner, slots, None, context_lens, block_tables, decode_only=True, num_splits=num_splits,
                   groups=groups, prefix_splits=prefix_splits, states=states)

    def segments(self, layer_idx: int, batch: int, length: int, device) -> Segments:
        """A linear-attention layer's sequences and their states from the pool (`rlcu/engine/states.py`)."""
        cu, slots, fresh, decode = self.states
        return self.runner.states.read(layer_idx, cu, slots, fresh, decode)

    def keep(self, layer_idx: int, conv: torch.Tensor, matrix: torch.Tensor) -> None:
        self.runner.states.write(layer_idx, self.states[1], conv, matrix)

    def __call__(self, layer_idx, q, k, v, cos, sin, scale, window=None, qk_norm=None, sinks=None, softcap=None):
        i = self.runner.kv_index[layer_idx]
        kc, vc = self.runner.k_cache[i], self.runner.v_cache[i]
        norm = ()
        if qk_norm is not None:
            q, k, norm = qk_norm_operands(q, k, qk_norm)
        q = rope_store_kv(q[0], k[0], v[0], cos[0, :, 0], sin[0, :, 0], kc, vc, self.slots, *norm)
        if self.decode_only and self.groups is not None:
            out = shared_prefix_decode_triton(q, kc, vc, self.tables, self.ctx, *self.groups, scale,
                                              self.num_splits, self.prefix_splits, softcap=softcap)
        elif self.decode_only:
            out = decode_attention(q, kc, vc, self.tables, self.ctx, scale, self.num_splits, window=window,
                                   sinks=sinks, softcap=softcap)
        else:
            out = paged_attention(q, kc, vc, self.cu, self.ctx, self.tables, scale, self.tiles, window=window,
                                  sinks=sinks, softcap=softcap, decode_rows=self.exact_decode)
        return out[None]


def decode_rows(n: int, device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """cu_seqlens and the prefill kernel's query tiles for n sequences of one query each."""
    cu = torch.arange(n + 1, dtype=torch.int32, device=device)
    return cu, (cu[:-1], torch.zeros(n, dtype=torch.int32, device=device))
