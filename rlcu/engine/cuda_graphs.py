"""CUDA graphs of the decode step. A decode step of a small model is hundreds of short kernels whose
launch cost from Python exceeds their run time; replaying a captured graph launches them all at once.

One graph per batch-size bucket, captured on first use, over static input buffers: the step's real
rows are copied in and the rest of the bucket is padding that writes no KV (slot -1) and whose
logits are ignored. The graphs read the KV pool and the model's parameters at their addresses, so
they live exactly as long as the pool (the model runner) and parameters must be updated in place,
which optimizers do."""
from __future__ import annotations

import weakref

import torch

from rlcu.engine.paged_attention import PagedAttention
from rlcu.kernels.decode_attention import default_num_splits
from rlcu.kernels.shared_prefix_decode import prefix_plan

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up and capture: cuBLAS keeps a workspace for each
    stream it has seen, so a fresh stream per capture would leak tens of MB per rollout."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def bucket_for(n: int, max_batch: int) -> int:
    for b in BUCKETS:
        if b >= n:
            return min(b, max_batch)
    return max_batch


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks_per_seq: int):
        dev = runner.device
        # a weak reference: a cycle runner <-> graphs would keep a released KV pool alive until the next gc
        self.runner, self.max_batch = weakref.proxy(runner), max_batch
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # shared-prefix groups (see kernels/shared_prefix_decode.py): room for every possible group
        self.order = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(max_batch + 1, dtype=torch.int32, device=dev)
        self.shared = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.skip = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        # exact_logprobs: every row a sequence of one query for the prefill kernel
        self.cu = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.tile_starts = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        # a hybrid's state slots; padding rows update the pool's scratch slot
        self.state_slots = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # off while decoding runs beside other GPU work (stream.DecodeBeside): a capture then would make that work's
        # allocations fail, so a batch without its graph yet runs eagerly
        self.capture = True

    def fits(self, n: int, width: int) -> bool:
        return n <= self.max_batch and width <= self.block_tables.shape[1]

    def run(self, ids, positions, slots, context_lens, tables, groups=None, state_slots=None) -> torch.Tensor:
        """Inputs as CPU tensors of the n real rows -> logits [n, vocab] (the model dtype, valid until the next run).
        `groups`: (order, starts, shared, skip) numpy arrays of `prefix_groups`, for shared-prefix decode.
        `state_slots`: the rows' recurrent-state slots (a hybrid's)."""
        n, width = len(ids), tables.shape[1]
        bucket = bucket_for(n, self.max_batch)
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.slots[n:bucket].fill_(-1)
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        if state_slots is not None:
            self.state_slots[:n].copy_(state_slots, non_blocking=True)
            self.state_slots[n:bucket].fill_(self.runner.states.scratch)
        plan = None
        if groups is not None:
            order, starts, shared, skip = groups
            g = len(shared)
            plan = prefix_plan(g, int(shared.max()), self.runner.model.config.num_key_value_heads)
            self.order[:n].copy_(torch.from_numpy(order), non_blocking=True)
            self.starts[:g + 1].copy_(torch.from_numpy(starts), non_blocking=True)
            self.starts[g + 1:plan[0] + 1].fill_(int(starts[-1]))  # the slots past the real groups have no members
            self.shared[:g].copy_(torch.from_numpy(shared), non_blocking=True)
            self.skip[:n].copy_(torch.from_numpy(skip), non_blocking=True)
            self.skip[n:bucket].fill_(0)  # padding rows: no prefix partials to read
        kind = self.runner.device.type
        key = (bucket, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None, plan)
        if key not in self.graphs:
            if not self.capture:
                return self._forward(bucket, key[1], plan)[:n]
            self.graphs[key] = self._capture(bucket, key[1], plan)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _forward(self, bucket: int, autocast_dtype, plan: tuple[int, int] | None):
        runner, hkv = self.runner, self.runner.model.config.num_key_value_heads
        splits = default_num_splits(bucket, hkv, self.block_tables.shape[1] * runner.k_cache.shape[2])
        groups = prefix_splits = None
        if plan is not None:  # (group slots, prefix splits) of prefix_plan
            slots, prefix_splits = plan
            groups = (self.order[:bucket], self.starts[:slots + 1], self.shared[:slots], self.skip[:bucket])
        exact_rows = (self.cu[:bucket + 1], (self.cu[:bucket], self.tile_starts[:bucket]))  # the graph's own buffers
        states = None if runner.states is None else (self.cu[:bucket + 1], self.state_slots[:bucket], None, True)
        attention = PagedAttention.decode(runner, self.slots[:bucket], self.context_lens[:bucket],
                                          self.block_tables[:bucket], exact_rows, splits, groups, prefix_splits,
                                          states)
        # the autocast cache would keep casts made during capture alive outside the graph's memory
        with torch.autocast(self.runner.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None, cache_enabled=False):
            hidden = runner.model(self.ids[None, :bucket], self.positions[None, :bucket], attention)
            return runner.model.lm_head(hidden[0], runner.exact)  # the model dtype: the samplers upcast as they read

    def _capture(self, bucket: int, autocast_dtype, plan):
        # the warm-up runs the step for real: it must not write the rows' KV or, worse, advance their recurrent
        # states (a hybrid's), which the replay that follows advances again; it writes to no slot and the scratch
        slots, state_slots = self.slots.clone(), self.state_slots.clone()
        self.slots.fill_(-1)
        if self.runner.states is not None:
            self.state_slots.fill_(self.runner.states.scratch)
        stream = capture_stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, cuBLAS picks kernels
            self._forward(bucket, autocast_dtype, plan)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        self.slots.copy_(slots)
        self.state_slots.copy_(state_slots)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            logits = self._forward(bucket, autocast_dtype, plan)
        return graph, logits
