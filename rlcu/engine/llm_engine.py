"""The engine API: generate completions for many prompts with continuous batching over a paged KV
cache, sharing each prompt's blocks among its samples (the prompt is prefilled once, then forked)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlcu.engine.block_manager import BlockManager
from rlcu.engine.model_runner import ModelRunner, cache_dtype
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.sequence import Sequence
from rlcu.kernels.sampling import sample
from rlcu.models.llama import CausalLM
from rlcu.models.sharding import is_sharded
from rlcu.rollout.base import RolloutBatch, SamplingParams
from rlcu.rollout.stops import StopStrings

log = logging.getLogger(__name__)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 device tensor without waiting for the GPU: `torch.tensor(..., device=cuda)`
    is a blocking copy, which first drains the stream, and with it a decode step launched ahead."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor):
    """Start copying a step's samples to the host; returns (tokens, logprobs, event to wait on). On CUDA the
    copies go to pinned memory ahead of any later work, so that waiting for them does not wait for a
    decode step launched after them."""
    if not tokens.is_cuda:
        return tokens, logprobs, None
    t = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
    lp = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True).copy_(logprobs, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return t, lp, ready


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    memory_fraction: float = 0.5  # at most this share of the GPU's free memory goes to the KV pool
    num_blocks: int | None = None  # a fixed pool size instead of what the requests need (capped as above)
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (GPU with Triton only)
    release_memory: bool = True  # free the pool (and graphs) after each generate(), for the training phase
    # launch decode step n+1 on the GPU's tokens while the host finishes step n (on an H200: 512 sequences
    # 48,091 -> 57,042 tok/s, 64 sequences 25,718 -> 29,163; docs/benchmarks.md, 2026-11-30)
    lookahead: bool = True
    # decode attention reads a group's shared prompt blocks once for all its samples (Triton on CUDA). None:
    # where the Triton kernels run, for decode steps of 256 sequences or more (on an H200, 32 x 8 x 512:
    # generation 2.40 -> 2.26 s; at 16 x 8 and 8 x 8 it costs 0.11-0.13 s; docs/benchmarks.md). True: at
    # any batch size (and a warning where it cannot run); False: never
    shared_prefix: bool | None = None

    def __post_init__(self):
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        self.runner: ModelRunner | None = None
        self.stats: dict[str, int] = {}
        self._said_no_shared_prefix = False

    def _pool_size(self, seqs: list[Sequence], forks: int) -> int:
        """What the requests can need at most (no sharing assumed), or `num_blocks`; on the GPU capped at
        `memory_fraction` of free memory (the scheduler preempts when the cap bites)."""
        cfg, bs = self.config, self.config.block_size
        want = cfg.num_blocks
        if want is None:
            want = sum(-(-(s.num_prompt_tokens + s.max_tokens) // bs) * (1 + s.pending_forks) for s in seqs) + forks
        device = self.model.model.embed_tokens.weight.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            held = 0 if self.runner is None else self.runner.k_cache.nbytes * 2  # ours to reuse
            cap = int((free + held) * cfg.memory_fraction) // ModelRunner.bytes_per_block(self.model, bs)
            want = min(want, max(1, cap))
        return want

    def release(self, force: bool = False) -> None:
        """Free the KV pool and the CUDA graphs (unless release_memory is off); the next generate() takes them again."""
        if not (self.config.release_memory or force):
            return
        self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor, bm: BlockManager):
        """Launch the next decode step of `seqs` on the GPU's sampled `tokens` before the host has them,
        so that the host's bookkeeping of this step overlaps the GPU's next step. Sequences that reach
        their length now are left out; one that samples a stop token is computed for nothing and dropped.
        Returns None (the caller schedules normally) when the step would need a block the pool lacks."""
        keep = [i for i, s in enumerate(seqs) if len(s.token_ids) - s.num_prompt_tokens + 1 < s.max_tokens]
        grow = [seqs[i] for i in keep if not bm.tail_has_room(seqs[i])]
        if not keep or sum(bm.blocks_needed(s, 1) for s in grow) > bm.num_free:
            return None
        if len(keep) < len(seqs):
            tokens = tokens[to_device(keep, tokens.device)]
            seqs = [seqs[i] for i in keep]
        for s in grow:
            bm.reserve(s, 1)
        self.runner.copy_blocks(bm.pending_copies)
        bm.pending_copies.clear()
        logits, seqs = self.runner.decode(seqs, bm.block_size, ids=tokens)
        return seqs, logits

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        # never inference tensors, even when called from Lightning's validation loop: a kept pool is
        # written again by later rollouts outside inference mode
        with torch.inference_mode(False), torch.no_grad():
            return self._generate(prompt_token_ids, sampling)

    def _generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        stops = frozenset(sampling.stop_token_ids)
        stop_strings = StopStrings(self.tokenizer, sampling.stop)
        parents: list[Sequence] = []
        for i, prompt in enumerate(prompt_token_ids):  # adjacent identical prompts: one prefill, then fork
            # (a family never outgrows max_num_seqs, the largest batch a decode step, and its graph, holds)
            if parents and prompt_token_ids[i - 1] == prompt and parents[-1].pending_forks + 1 < self.config.max_num_seqs:
                parents[-1].pending_forks += 1
                continue
            parents.append(Sequence(list(prompt), len(prompt), sampling.max_tokens, stops, request_index=i))
        num_blocks = self._pool_size(parents, len(prompt_token_ids))
        runner = self.runner
        addresses = [p.data_ptr() for p in self.model.parameters()]
        if (runner is None or runner.k_cache.shape[1] < num_blocks or runner.param_addresses != addresses
                or runner.dtype != cache_dtype(self.model.model.embed_tokens.weight)):
            # a kept pool's CUDA graphs read the parameters at their captured addresses: parameters that
            # moved (FSDP gathers them anew for each rollout; a user's model.to()) need new graphs
            self.runner = None  # the old pool goes before the new one is taken
            # a sharded model decodes eagerly: graphs of its gathered parameters are not yet tested on a GPU
            graphs = self.config.cuda_graphs and not is_sharded(self.model)
            self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.config.max_num_seqs, graphs,
                                      shared_prefix=self.config.shared_prefix)
            if self.config.shared_prefix is True and not self.runner.shared_prefix and not self._said_no_shared_prefix:
                self._said_no_shared_prefix = True  # once per engine, not at every rollout
                log.warning("shared_prefix needs the Triton kernels (a CUDA device, a power-of-two head_dim >= 16): "
                            "decoding with the plain attention kernel instead")
            self.runner.param_addresses = addresses
        bm = BlockManager(self.runner.k_cache.shape[1], self.config.block_size)
        scheduler = Scheduler(bm, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        for seq in parents:
            scheduler.add(seq)
        device = self.runner.device
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ()).item())
        done: dict[int, Sequence] = {}
        steps = lookahead_steps = 0
        ahead = None  # (sequences, logits) of a decode step launched before the host saw the previous tokens
        while not scheduler.is_finished():
            if ahead is not None:
                (seqs, logits), ahead, decode_only = ahead, None, True
            else:
                batch = scheduler.schedule()
                decode_only = not scheduler.prefilled  # no prefill chunk, so no fork either
                self.runner.copy_blocks(bm.pending_copies)
                bm.pending_copies.clear()
                logits, seqs = self.runner.run(batch, bm, decode_only)
            steps += 1
            if not seqs:
                continue
            owners, rows = seqs, None  # rows: which logits row each owner samples from, when forks share one
            if not decode_only:  # a prefill that completes forks its prompt's other samples
                owners, rows = [], []
                for row, seq in enumerate(seqs):
                    family = [seq]
                    for k in range(seq.pending_forks):  # samples 2..G of a prompt share its blocks from here on
                        child = bm.fork(seq)
                        child.request_index = seq.request_index + 1 + k
                        scheduler.running.append(child)
                        family.append(child)
                    seq.pending_forks = 0
                    rows += [row] * len(family)
                    owners += family
            # each draw is seeded by (run seed, request, token index): reproducible whatever the batching
            seeds = to_device([hash((base_seed, s.request_index, s.num_completion_tokens)) & (2**62 - 1)
                               for s in owners], device)
            if rows is not None and rows != list(range(len(seqs))):
                logits = logits[to_device(rows, device)]
            tokens, logprobs = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                      seeds=seeds)
            on_device = tokens
            tokens, logprobs, ready = to_host(tokens, logprobs)  # on CUDA: not yet written until `ready`
            if decode_only and not scheduler.waiting and self.config.lookahead:
                ahead = self._launch_ahead(owners, on_device, bm)  # the GPU computes it while the host goes on
                lookahead_steps += ahead is not None
            if ready is not None:
                ready.synchronize()
            for seq, tok, lp in zip(owners, tokens.tolist(), logprobs.tolist()):
                seq.append(tok, lp)
                if seq.finish_reason is None and stop_strings and stop_strings.hit(seq.completion_token_ids):
                    seq.finish_reason = "stop"
                if seq.finish_reason is not None:
                    scheduler.finish(seq)
                    done[seq.request_index] = seq
            if ahead is not None and any(s.finish_reason for s in ahead[0]):  # their rows were computed for nothing
                keep = [i for i, s in enumerate(ahead[0]) if s.finish_reason is None]
                ahead = ([ahead[0][i] for i in keep], ahead[1][to_device(keep, device)]) if keep else None
        self.stats = {"steps": steps, "lookahead_steps": lookahead_steps, "preemptions": scheduler.num_preemptions, "num_blocks": bm.num_blocks}
        if bm.num_free != bm.num_blocks:
            raise AssertionError(f"{bm.num_blocks - bm.num_free} KV blocks leaked")
        ordered = [done[i] for i in range(len(prompt_token_ids))]
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_token_ids],
                            completion_ids=[s.completion_token_ids for s in ordered],
                            logprobs=[s.logprobs for s in ordered], finish_reasons=[s.finish_reason for s in ordered])
