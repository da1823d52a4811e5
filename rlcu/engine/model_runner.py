"""Runs one engine step: the scheduled tokens of all sequences as one flat batch through the rlcu
model's own modules and parameters, with attention over the paged KV cache. Decode-only steps on the
GPU replay a CUDA graph (`cuda_graphs.py`)."""
from __future__ import annotations

import numpy as np
import torch

from rlcu.contracts import Numerics, SamplingParams
from rlcu.engine.block_manager import BlockManager, blocks_for
from rlcu.engine.cuda_graphs import DecodeGraphs
from rlcu.engine.paged_attention import PagedAttention, cache_dtype
from rlcu.engine.routing import RoutingCache
from rlcu.engine.sequence import Sequence
from rlcu.engine.states import StatePool
from rlcu.kernels._triton import use_triton
from rlcu.kernels.decode_attention import triton_supports
from rlcu.kernels.kv_cache import as_bytes
from rlcu.kernels.prefill_attention import BLOCK_M, query_tiles
from rlcu.kernels.sampling import penalize_repeats, sample
from rlcu.kernels.shared_prefix_decode import prefix_groups, prefix_plan
from rlcu.kernels.token_logprob import token_logprob
from rlcu.models.attention import fuses_qk_norm
from rlcu.models.decoder import CausalLM

# Below this many sequences a decode step's KV reads are too few for shared-prefix decode to pay for its
# extra kernel (measured in docs/engine.md)
SHARED_PREFIX_MIN_SEQS = 256


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 cuda_graphs: bool = True, shared_prefix: bool | None = False, kv_cache_dtype: str = "auto",
                 numerics: Numerics = Numerics.FAST, num_state_slots: int = 0,
                 state_dtype: torch.dtype = torch.float32):
        cfg = model.config
        self.model = model  # the module's own: its parameters are read in place, never copied
        # KV for the attention layers only; a hybrid's linear-attention layers keep a state per request instead
        self.kv_index = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        shape = (len(self.kv_index), num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.dtype, self.device = cache_dtype(model, kv_cache_dtype), model.device
        # zeros, not empty: a padding row of a graph batch reads block 0, and must not read NaN
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.states = (StatePool(cfg, num_state_slots, model.compute_dtype(), self.device, state_dtype)
                       if cfg.linear_layers else None)
        self.routing = RoutingCache(cfg, num_blocks * block_size, self.device) if cfg.is_moe else None
        self.param_addresses: list[int] = []  # where the parameters were when this runner's graphs were made
        self.graphs = None
        # shared-prefix decode is a Triton kernel: the PyTorch reference path reads every block per sequence.
        # None: on for decode steps of SHARED_PREFIX_MIN_SEQS or more; True: whenever blocks are shared
        triton = use_triton(self.k_cache)
        # EXACT: every step through the one attention kernel, RoPE + KV-write kernel (with the q/k norms where it
        # takes them) and GEMMs that the training forward uses (docs/engine.md)
        self.exact = numerics.batch_invariant
        if self.exact and not (triton and triton_supports(cfg.head_dim, block_size)):
            raise ValueError(f"exact_logprobs needs the Triton kernels with a power-of-two head_dim >= 16 (got "
                             f"{cfg.head_dim}) on a CUDA device (or RLCU_TRITON=1): set exact_logprobs: false")
        # a sliding window's first key would cut into the shared prompt's partial softmax: the plain kernel
        self.shared_prefix = (shared_prefix is not False and triton and triton_supports(cfg.head_dim, block_size)
                              and not self.exact and not cfg.windowed)
        self.shared_prefix_min_seqs = SHARED_PREFIX_MIN_SEQS if shared_prefix is None else 1
        self.fuse_qk_norm = fuses_qk_norm(cfg, self.k_cache)  # exact mode's training attention fuses them alike
        # experts decode in one grouped launch that reads their token counts on the device wherever Triton runs
        # (`rlcu/models/moe.py`, `grouped`), so a graph replays them
        if cuda_graphs and self.device.type == "cuda" and triton and triton_supports(cfg.head_dim, block_size):
            max_blocks = min(num_blocks, blocks_for(cfg.max_position_embeddings, block_size))
            self.graphs = DecodeGraphs(self, max_num_seqs, max_blocks)

    def sample(self, logits: torch.Tensor, owners: list[Sequence], rows: list[int] | None, sp: SamplingParams,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each owner's next token and its logprob. Each draw is seeded by (run seed, request, token index):
        reproducible whatever the batching. `rows`: which logits row each owner samples from, when forks share
        their parent's."""
        seeds = to_device([hash(s.draw_key(seed)) & (2**62 - 1) for s in owners],
                          self.device)
        if rows is not None and rows != list(range(len(logits))):
            logits = logits[to_device(rows, self.device)]
        if sp.repetition_penalty != 1.0:
            logits = penalize_repeats(logits, [s.token_ids for s in owners], sp.repetition_penalty)
        tokens, logprobs = sample(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p, seeds=seeds)
        if self.exact and sp.temperature > 0:  # the trainer's log-softmax kernel, on the same logits
            logprobs = token_logprob(logits, tokens, sp.temperature)[0]
        return tokens, logprobs

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            for cache in (as_bytes(self.k_cache), as_bytes(self.v_cache)):
                cache[:, dst] = cache[:, src]
            if self.routing is not None:
                self.routing.copy_blocks(src, dst, self.k_cache.shape[2])

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs and self.states is not None:
            self.states.copy(pairs)

    def state_rows(self, seqs: list[Sequence], fresh: list[bool] | None, cu: torch.Tensor, decode: bool):
        """(cu, state slots, which start from zeros or None, decode) of a step's sequences, for a hybrid's
        linear-attention layers; None for other models."""
        if self.states is None:
            return None
        slots = to_device([s.state_slot for s in seqs], self.device)
        fresh_t = to_device(fresh, self.device).bool() if fresh is not None and any(fresh) else None
        return cu, slots, fresh_t, decode

    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]], bm: BlockManager,
            decode_only: bool) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the scheduled tokens; return logits [n, vocab] for the sequences that now sample.
        `decode_only`: the scheduler's word that no prefill chunk is in the batch."""
        if decode_only:
            return self.decode([seq for seq, _ in batch], bm.block_size)
        ids, positions, slots, cu, ctx, tables, last, sampling = [], [], [], [0], [], [], [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [bm.slot(seq, p) for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            tables.append(seq.block_table)
            if start + n == len(seq):
                last.append(cu[-1] - 1)
                sampling.append(seq)
            seq.num_computed_tokens += n
        dev = self.device
        tiles = None if not use_triton(self.k_cache) else query_tiles(cu, BLOCK_M, dev)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
        states = self.state_rows([seq for seq, _ in batch], [seq.num_computed_tokens == n for seq, n in batch], cu_t,
                                 decode=all(n == 1 for _, n in batch))
        attention = PagedAttention(self, torch.tensor(slots, device=dev), cu_t,
                                   torch.tensor(ctx, dtype=torch.int32, device=dev), padded_table(tables).to(dev),
                                   decode_only=False, tiles=tiles, states=states)
        hidden = self.model(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), attention)
        if not sampling:
            return hidden.new_empty(0, self.model.config.vocab_size), []
        # the samplers upcast as they read
        return self.model.lm_head(hidden[0, torch.tensor(last, device=dev)], self.exact), sampling

    def decode(self, seqs: list[Sequence], bs: int,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Sequence]]:
        """One new token per sequence: the hot loop of a rollout, kept to a few list comprehensions.
        `ids` (on the device): the tokens to compute, when the host has not appended them yet (the
        engine's look-ahead); by default each sequence's next uncomputed token."""
        positions = [s.num_computed_tokens for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        ctx = [p + 1 for p in positions]
        table = padded_table([s.block_table for s in seqs])
        if ids is None:
            ids = torch.tensor([s.token_ids[p] for s, p in zip(seqs, positions)])
        for s in seqs:
            s.num_computed_tokens += 1
        ids_t, pos_t, slots_t = ids, torch.tensor(positions), torch.tensor(slots)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        groups = None
        if self.shared_prefix and len(seqs) >= self.shared_prefix_min_seqs:
            groups = prefix_groups(table.numpy(), bs, ctx_t.numpy())
            if not len(groups[2]):  # nothing shared this step: the plain kernel
                groups = None
        if self.graphs is not None and self.graphs.fits(len(seqs), table.shape[1]):
            state_slots = None if self.states is None else torch.tensor([s.state_slot for s in seqs])
            return self.graphs.run(ids_t, pos_t, slots_t, ctx_t, table, groups, state_slots), seqs
        dev = self.device
        prefix_splits = None
        if groups is not None:
            prefix_splits = prefix_plan(len(groups[2]), int(groups[2].max()), self.model.config.num_key_value_heads)[1]
            groups = tuple(torch.from_numpy(a).to(dev) for a in groups)
        states = self.state_rows(seqs, None, torch.arange(len(seqs) + 1, dtype=torch.int32, device=dev), decode=True)
        attention = PagedAttention.decode(self, slots_t.to(dev), ctx_t.to(dev), table.to(dev), groups=groups,
                                          prefix_splits=prefix_splits, states=states)
        hidden = self.model(ids_t.to(dev)[None], pos_t.to(dev)[None], attention)
        return self.model.lm_head(hidden[0], self.exact), seqs


def padded_table(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 [n, longest] tensor, padded with block 0 (never read past a context). Row by row:
    a decode step of a few hundred long sequences builds it on the host at every step."""
    out = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int32)
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return torch.from_numpy(out)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 device tensor without waiting for the GPU: `torch.tensor(..., device=cuda)`
    is a blocking copy, which first drains the stream, and with it a decode step launched ahead."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
