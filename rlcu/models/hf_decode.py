"""Decoding the transformers fallback with fixed shapes: its HF modules run with rlcu's attention function,
registered through transformers' `AttentionInterface`, over a KV cache rlcu owns. transformers then builds no
mask and keeps no cache of its own, so one decode step is the same kernels on the same buffers every time,
and on CUDA it runs as a CUDA graph (one per width of the cache it reads, `COLS` columns apart): the HF
modules' launches, which bound the fallback's decode, are paid once per width, not once per token.

Only models that declare `_supports_attention_backend` (their attention goes through the interface) take this
path, sliding windows included; a model whose attention asks for what this function lacks (soft-capped scores,
sinks, a position bias, a mask of its own) is found at its prefill and falls back to transformers' own cache
(`HFIncremental`)."""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

NAME = "rlcu_static"
COLS = 128  # the widths of the cache a decode step reads grow by this many columns (one CUDA graph each)
_UNSUPPORTED = ("softcap", "s_aux", "position_bias")  # soft-capped scores, sinks, ALiBi-like biases
_active: StaticDecoder | None = None


class Unsupported(RuntimeError):
    """The model's attention asks for more than causal, padded attention over the static cache."""


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: (output [B, q, H, D], weights or None). Dropout is not
    applied: rollouts sample from the policy without it, as the training forward computes it (p = 0)."""
    asks = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if attention_mask is not None:  # transformers builds none for this function: the model made its own
        asks.append("a mask of the model's own")
    if _active is None or asks:
        raise Unsupported(f"rlcu's static-cache attention does not run {asks or 'outside a decoder'}")
    return _active.attend(module.layer_idx, query, key, value, scaling, kwargs.get("sliding_window")), None


@functools.cache
def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    return NAME


def supported(hf_model) -> bool:
    return bool(getattr(type(hf_model), "_supports_attention_backend", False))


def _bucket(n: int) -> int:
    """`n` columns rounded up to a whole number of COLS."""
    return -(-n // COLS) * COLS


class StaticDecoder:
    """The reference backend's `incremental` decoder for the fallback: a left-padded batch in lockstep, so
    every row writes decode step s's key at the same column; keys of padding columns are masked out."""

    def __init__(self, model, batch: int, max_len: int, slow):
        self.model, self.max_len, self.slow = model, _bucket(max_len), slow
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.cols, self.mask, self.col, self.next_col = 0, None, None, 0
        self.use_graphs = model.device.type == "cuda"
        self.pool = None

    def attend(self, layer: int, q, k, v, scale, window: int | None = None) -> torch.Tensor:
        """q [B, H, n, D], k/v [B, Hkv, n, D] of the forward's n new tokens -> [B, n, H, D]; a layer with a
        sliding `window` sees the last `window` keys up to each query (real tokens are contiguous in a row, so
        columns count positions)."""
        b, heads, n, d = q.shape
        if layer not in self.k:
            shape = (b, k.shape[1], self.max_len, d)
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros((*shape[:3], v.shape[-1]))
        if n > 1:
            self.k[layer][:, :, :n], self.v[layer][:, :, :n] = k, v
        else:
            self.k[layer].index_copy_(2, self.col, k)
            self.v[layer].index_copy_(2, self.col, v)
        keys, values = self.k[layer][:, :, :self.cols], self.v[layer][:, :, :self.cols]
        kv_heads = keys.shape[1]
        group = heads // kv_heads  # query heads kv_heads*j .. : transformers' repeat_kv order
        q = q.reshape(b, kv_heads, group * n, d)
        mask = self.mask if window is None else self.mask & self._window(n, window)
        mask = mask if group == 1 or n == 1 else mask.repeat(1, 1, group, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(b, heads, n, -1).transpose(1, 2).contiguous()

    def _window(self, n: int, window: int) -> torch.Tensor:
        """[n, cols]: the keys within `window` positions of each of the forward's n queries."""
        keys = self.arange[:self.cols]
        queries = keys[-n:, None] if n > 1 else self.col[:, None]
        return queries - keys[None, :] < window

    @contextlib.contextmanager
    def _running(self):
        global _active
        hf, was = self.model.hf, self.model.hf.training
        old = hf.config._attn_implementation
        hf.config._attn_implementation, _active = register(), self
        hf.train(False)  # no activation checkpointing while decoding
        try:
            yield
        finally:
            hf.config._attn_implementation, _active = old, None
            hf.train(was)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model.hf(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, p = ids.shape
        if self.max_len < p + 1:
            self.max_len = _bucket(p + 1)
        self.valid = torch.ones(b, self.max_len, dtype=torch.bool, device=ids.device)
        self.valid[:, :p] = valid
        self.arange = torch.arange(self.max_len, device=ids.device)
        eye = torch.eye(p, dtype=torch.bool, device=ids.device)
        # a padding row attends to itself only, so no row is all -inf (NaN) and padding stays finite
        self.mask = ((torch.tril(torch.ones_like(eye)) & valid[:, None, :]) | eye)[:, None]
        self.cols, self.next_col = p, p
        self.col = torch.full((1,), p, dtype=torch.long, device=ids.device)
        try:
            with self._running():
                return self._forward(ids, pos)
        except Unsupported as e:
            log.warning("%s: %s; it decodes over transformers' own KV cache", self.model.config.model_type, e)
            self.model.static_decoding, self.k, self.v = False, {}, {}
            self.slow = self.slow()
            return self.slow.prefill(ids, valid, pos)

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not callable(self.slow):
            return self.slow.step(tok, pos)
        col, self.next_col = self.next_col, self.next_col + 1
        if col >= self.max_len:
            raise ValueError(f"decoding past the static cache's {self.max_len} columns")
        self.col.fill_(col)
        cols = min(_bucket(col + 1), self.max_len)
        if not self.use_graphs:
            with self._running():
                return self._decode(tok[:, None], pos, cols)
        if cols not in self.graphs:
            return self._capture(tok, pos, cols)
        graph, logits = self.graphs[cols]
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos)
        graph.replay()
        return logits

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor, cols: int) -> torch.Tensor:
        self.cols = cols
        self.mask = (self.valid[:, :cols] & (self.arange[:cols] <= self.col))[:, None, None]
        return self._forward(tok, pos)

    def _capture(self, tok: torch.Tensor, pos: torch.Tensor, cols: int) -> torch.Tensor:
        """This step runs eagerly (its result is returned) on a side stream, as CUDA graphs want before a
        capture, then the same step is captured for width `cols`; a model whose forward cannot be captured
        decodes eagerly from here on."""
        if not self.graphs:
            self.tok, self.pos = tok[:, None].clone(), pos.clone()
            self.pool = torch.cuda.graph_pool_handle()
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        kind = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        with self._running(), torch.cuda.stream(side):
            logits = self._decode(self.tok, self.pos, cols).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # the casts of an autocast region are captured too, so each replay reads the live weights
            with self._running(), torch.autocast("cuda", dtype=kind or torch.bfloat16, enabled=kind is not None,
                                                 cache_enabled=False), torch.cuda.graph(graph, pool=self.pool):
                out = self._decode(self.tok, self.pos, cols)
        except RuntimeError as e:
            log.warning("the fallback's decode step could not be captured as a CUDA graph (%s); it runs eagerly",
                        str(e).splitlines()[0])
            self.use_graphs = False
            return logits
        self.graphs[cols] = (graph, out)
        return logits
