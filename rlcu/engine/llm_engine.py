"""The engine API: generate completions for many prompts with continuous batching over a paged KV
cache, sharing each prompt's blocks among its samples (the prompt is prefilled once, then forked).

`generate()` plans the requests, sets up the model runner (KV pool, CUDA graphs), then calls `step()`
until the scheduler has nothing left: schedule, run, sample, post-process.

With a `continuation` a request is an episode of turns: when a turn ends, its sequence is parked with
its KV blocks and the continuation runs in a worker thread (a tool call, an environment's answer) while
the other episodes decode; its reply's tokens are appended and only they are prefilled before the next
turn. Parked blocks are taken back under memory pressure, and every block is free when generate() returns."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from rlcu.contracts import (
    Continuation,
    GenerationInterrupted,
    Numerics,
    Reply,
    RolloutBatch,
    SamplingParams,
    Spawns,
    StopStrings,
    Turn,
    check_reply,
    continuation_spawns,
    continuation_workers,
    later_reply,
    replies_later,
    turn_bound,
)
from rlcu.engine.block_manager import BlockManager
from rlcu.engine.model_runner import ModelRunner, to_device
from rlcu.engine.paged_attention import KV_CACHE_DTYPES, cache_dtype
from rlcu.engine.pool import pool_size
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.sequence import Sequence
from rlcu.engine.states import STATE_DTYPES, bytes_per_slot, state_dtype
from rlcu.kernels.decode_attention import DECODE_BLOCK_N_FP8
from rlcu.models.decoder import CausalLM

log = logging.getLogger(__name__)
# the widest key tile of the attention kernels (FP8 decode's; prefill's is 64): a sliding window's first key is read
# from a multiple of it
KEY_TILE = DECODE_BLOCK_N_FP8
STOP_CHECK_STEPS = 16  # decode steps between looks at the stop flag: about 30 ms on an H200, well under a second on CPU


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


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds inside at least one of the (start, end) spans: an episodes' rollout's time with a turn awaiting its
    reply (where the engine decoded only the others, if any)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(b - max(a, reach), 0.0)
        reach = max(reach, b)
    return total


def routing_to_host(seqs: list[Sequence]) -> list[torch.Tensor] | None:
    """Each sequence's routing record ([completion tokens, MoE layers, k]), brought to the host in one copy;
    None for a dense model's."""
    parts = [s.routing for s in seqs]
    if not parts or any(p is None for p in parts):
        return None
    return list(torch.cat(parts).cpu().split([len(p) for p in parts]))


def as_turn(seq: Sequence) -> Turn:
    """A sequence's turn as it ended: what continuations and `on_finished` are handed."""
    return Turn(seq.request_index, seq.completion_token_ids, seq.finish_reason, list(seq.logprobs))


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256  # sequences in one decode step (and the largest CUDA graph)
    max_num_batched_tokens: int = 8192  # tokens in one step (decodes plus prefill chunks)
    memory_fraction: float = 0.5  # at most this share of the device's free memory goes to the KV pool
    num_blocks: int | None = None  # a fixed pool size instead of what the requests need (capped as above)
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (GPU with Triton only)
    release_memory: bool = True  # free the pool (and graphs) after each generate(), for the training phase
    # launch decode step n+1 on the GPU's tokens while the host finishes step n (docs/engine.md)
    lookahead: bool = True
    # decode attention reads a group's shared prompt blocks once for all its samples (Triton on CUDA).
    # None: from SHARED_PREFIX_MIN_SEQS sequences per decode step, where it pays (docs/engine.md);
    # True: at any batch size (a warning where it cannot run); False: never
    shared_prefix: bool | None = None
    continuation_workers: int = 16  # threads that run continuations (tools, environments) beside decoding
    # the CUDA stream priority of decode steps run beside other work (streaming's decode_steps_during_training):
    # lower is sooner, as torch.cuda.Stream's (-1: their kernels take SMs ahead of the training's as these free up)
    beside_priority: int = 0
    # "auto": keys and values in the forward's dtype; "fp8" (or "fp8_e4m3", vLLM's names): e4m3 with unit scale,
    # half the bytes a decode step reads and twice the sequences a pool holds, for a logprob cost (docs/engine.md)
    kv_cache_dtype: str = "auto"
    # a hybrid's delta-rule states in the pool (vLLM's name): "float32", or "bfloat16" / "float16" (half the bytes a
    # decode step moves, each step's state rounded once; docs/engine.md), or "auto" (the forward's dtype)
    mamba_ssm_cache_dtype: str = "float32"
    # EXACT: decode and prefill through the training forward's kernels, so sampled logprobs equal the trainer's
    # to the bit (GRPOModule's exact_logprobs sets it; over an FP8 cache it becomes EXACT_FP8, which the training
    # forward must take too); FAST: the fastest kernels
    numerics: Numerics = Numerics.FAST

    def __post_init__(self):
        self.numerics = Numerics(self.numerics)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {sorted(STATE_DTYPES)}, got "
                             f"{self.mamba_ssm_cache_dtype!r}")
        if self.numerics.batch_invariant:  # the exact numerics of this cache (the trainer must take the same)
            if self.numerics is Numerics.EXACT_FP8 and self.kv_cache_dtype == "auto":
                raise ValueError("numerics exact_fp8 read an FP8 KV cache: set kv_cache_dtype: fp8, or numerics: exact")
            self.numerics = Numerics.exact(self.kv_cache_dtype)
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError(f"block_size and max_num_seqs must be >= 1, got {self.block_size}, {self.max_num_seqs}")
        if not isinstance(self.beside_priority, int) or isinstance(self.beside_priority, bool):
            raise ValueError(f"beside_priority must be an integer CUDA stream priority (0, or -1 to run ahead of the "
                             f"training's kernels), got {self.beside_priority!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs "
                             "(every running sequence decodes each step)")


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        model.check_numerics(self.config.numerics)
        states = self.config.mamba_ssm_cache_dtype
        if (self.config.numerics.batch_invariant and getattr(model.config, "linear_layers", None)
                and state_dtype(model, states) != torch.float32):
            raise ValueError(f"exact logprobs run the trainer's delta rule on fp32 states, and mamba_ssm_cache_dtype="
                             f"{states} rounds the sampler's: set mamba_ssm_cache_dtype: float32, or leave "
                             "exact_logprobs off")
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None  # of the generate() in progress
        self.stats: dict[str, int] = {}
        self._said_no_shared_prefix = False
        self._should_stop: Callable[[], bool] | None = None  # the generate() in progress's
        self.stream = None  # an open EngineStream (engine/stream.py), which holds the scheduler between its runs
        self._pausing = False  # no decode step is launched ahead: the stream is about to hand the GPU to training
        self._turns: tuple[ThreadPoolExecutor, int] | None = None  # continuations' threads, and how many it may run

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 continuation: Continuation | None = None, on_finished: Callable[[Turn], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> RolloutBatch:
        """Completions of the prompts; with a `continuation`, episodes of several turns (module docstring).
        `on_finished`: called from the decode loop with each request's completion (a `Turn`) the step it ends,
        while the others still decode; it must return quickly (hand its work to another thread). `should_stop`:
        asked every STOP_CHECK_STEPS steps; when it says yes, GenerationInterrupted ends the rollout."""
        # never inference tensors, even when called from Lightning's validation loop: a kept pool is
        # written again by later rollouts outside inference mode
        if self.stream is not None:
            raise RuntimeError("a stream is open on this engine (streaming GRPO): close it before generate()")
        with torch.inference_mode(False), torch.no_grad():
            parents = self._requests(prompt_token_ids, sampling, 0, sampling.seed)
            spawns = continuation_spawns(continuation)
            if spawns is not None and spawns.first != len(prompt_token_ids):
                raise ValueError(f"the continuation's spawned requests are numbered from {spawns.first}, not after "
                                 f"the rollout's {len(prompt_token_ids)} prompts")
            spawned = (spawns.capacity, spawns.max_prompt_tokens) if spawns is not None else (0, 0)
            slots = len(prompt_token_ids) + spawned[0] if self.model.config.linear_layers else 0
            state_bytes = slots * self._bytes_per_slot() if slots else 0
            self._prepare_runner(pool_size(parents, self.config, self.model, self._pool_bytes_held(), state_bytes,
                                           spawned), slots)
            self._start(parents, sampling, continuation is not None, on_finished, state_slots=slots)
            self._should_stop = should_stop
            if continuation is None:
                while not self.scheduler.is_finished():
                    self.step()
                    self._check_stop()
            else:
                self._run_episodes(continuation, spawns)
            return self._result(list(prompt_token_ids) + self._spawned)

    def release(self, force: bool = False) -> None:
        """Free the KV pool and the CUDA graphs (unless release_memory is off); the next generate() takes them again."""
        if self.stream is not None:  # its sequences are recomputed when it runs again
            self.stream.release(force)
            return
        if not (self.config.release_memory or force):
            return
        self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> None:
        """Run the scheduled batch (or the decode step launched ahead), sample each sequence's next token,
        and let the scheduler post-process: append, stop, finish."""
        seqs, logits, decode_only = self._forward()
        self._steps += 1
        if not seqs:
            return
        owners, rows = (seqs, None) if decode_only else self.scheduler.fork_prefilled(seqs)
        tokens, logprobs = self.runner.sample(logits, owners, rows, self._sampling, self._seed)
        host_tokens, host_logprobs, ready = to_host(tokens, logprobs)  # on CUDA: written once `ready`
        if decode_only and not self.scheduler.waiting and self.config.lookahead and not self._pausing:
            self._ahead = self._launch_ahead(owners, tokens)  # the GPU computes it while the host goes on
            self._lookahead_steps += self._ahead is not None
        if ready is not None:
            ready.synchronize()
        self._turns_ended += self.scheduler.postprocess(owners, host_tokens.tolist(), host_logprobs.tolist())
        if self._ahead is not None and any(s.finish_reason for s in self._ahead[0]):  # rows computed for nothing
            keep = [i for i, s in enumerate(self._ahead[0]) if s.finish_reason is None]
            self._ahead = ([self._ahead[0][i] for i in keep], self._ahead[1][to_device(keep, self.runner.device)]
                           ) if keep else None

    def _forward(self) -> tuple[list[Sequence], torch.Tensor, bool]:
        """(sequences that sample, their logits, whether the step was decodes only)."""
        if self._ahead is not None:
            (seqs, logits), self._ahead = self._ahead, None
            return seqs, logits, True
        batch, decode_only = self.scheduler.schedule()
        self._copy_pending_blocks()
        logits, seqs = self.runner.run(batch, self.scheduler.bm, decode_only)
        return seqs, logits, decode_only

    def _launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor):
        """Launch the next decode step of `seqs` on the GPU's sampled `tokens` before the host has them,
        so that the host's bookkeeping of this step overlaps the GPU's next step. Sequences that reach
        their length now are left out; one that samples a stop token is computed for nothing and dropped.
        Returns None (the caller schedules normally) when the step would need a block the pool lacks."""
        bm = self.scheduler.bm
        keep = [i for i, s in enumerate(seqs) if s.num_completion_tokens + 1 < s.turn_limit]
        grow = [seqs[i] for i in keep if not bm.tail_has_room(seqs[i])]
        if not keep or sum(bm.blocks_needed(s, 1) for s in grow) > bm.num_free:
            return None
        if len(keep) < len(seqs):
            tokens = tokens[to_device(keep, tokens.device)]
            seqs = [seqs[i] for i in keep]
        for s in grow:
            bm.reserve(s, 1)
        self._copy_pending_blocks()
        logits, seqs = self.runner.decode(seqs, bm.block_size, ids=tokens)
        return seqs, logits

    # ---- episodes ------------------------------------------------------------------------------------
    def _run_episodes(self, continuation: Continuation, spawns: Spawns | None = None) -> None:
        """Steps while continuations run beside them; when nothing is left to compute, wait for a reply (or for a
        request the continuation adds, `spawns`). The rollout ends when nothing runs, waits or may still be added."""
        pending: dict[Future, tuple[Sequence, float]] = {}  # a turn's continuation call: its sequence, when submitted
        pool = self._turn_pool(continuation_workers(continuation, self.config.continuation_workers))
        later, ended = replies_later(continuation), False
        try:
            while True:
                for seq in self._turns_ended:  # one that replies later is called here, and answers by its Future
                    future = (later_reply(continuation(as_turn(seq)), continuation) if later
                              else pool.submit(continuation, as_turn(seq)))
                    pending[future] = seq, time.perf_counter()
                self._turns_ended = []
                if spawns is not None:
                    self._add_spawned(spawns.take())
                idle = self.scheduler.is_finished() and self._ahead is None
                if idle and not pending:
                    if spawns is None or spawns.close():
                        ended = True
                        return
                    continue  # a request came in as the last episode ended: it runs first
                if idle:
                    start = time.perf_counter()
                    done = wait([*pending, *([spawns.arrived] if spawns is not None else [])],
                                return_when=FIRST_COMPLETED)[0]
                    self._waiting_s += time.perf_counter() - start
                else:
                    done = [f for f in pending if f.done()]
                for future in done:
                    if future in pending:
                        seq, submitted = pending.pop(future)
                        self._replies.append((submitted, time.perf_counter()))
                        self._apply_reply(seq, future.result())
                if not self.scheduler.is_finished() or self._ahead is not None:
                    self.step()
                    self._check_stop()
        finally:
            if spawns is not None:
                spawns.close(drop=True)
            if not ended:  # a continuation may still hold a thread: the next rollout gets threads of its own
                pool.shutdown(wait=False, cancel_futures=True)
                self._turns = None

    def _turn_pool(self, workers: int) -> ThreadPoolExecutor:
        """The threads that run continuations, kept from one rollout to the next: agent programs' turns each wait in
        a thread for the program's next call, and starting that many threads anew every rollout holds up its decode
        loop (each start waits for its thread, under the interpreter lock)."""
        if self._turns is None or self._turns[1] < workers:
            if self._turns is not None:
                self._turns[0].shutdown(wait=False)
            self._turns = ThreadPoolExecutor(workers, thread_name_prefix="rlcu-turn"), workers
        return self._turns[0]

    def _add_spawned(self, taken: list[tuple[int, list[int], int | None]]) -> None:
        """Requests a continuation added: sequences of their own, numbered after the rollout's prompts."""
        sampling = self._sampling
        for index, prompt, own in taken:
            self.scheduler.add(Sequence(list(prompt), len(prompt), sampling.max_tokens,
                                        frozenset(sampling.stop_token_ids), request_index=index,
                                        turn_limit=turn_bound(sampling.max_turn_tokens, own) or 0, seed=sampling.seed))
            self._spawned.append(list(prompt))

    def _apply_reply(self, seq, reply: Reply) -> None:
        check_reply(reply, seq.num_completion_tokens, seq.max_tokens)
        if reply.token_ids is None:
            self.scheduler.end(seq, reply.finish_reason)
        else:
            self.scheduler.resume(seq, list(reply.token_ids),
                                  turn_bound(self._sampling.max_turn_tokens, reply.max_turn_tokens))

    def _check_stop(self) -> None:
        if self._should_stop is not None and self._steps % STOP_CHECK_STEPS == 0 and self._should_stop():
            self.scheduler, self._ahead = None, None  # the next generate() starts afresh
            raise GenerationInterrupted(f"the run was asked to stop while the rollout was decoding (step "
                                        f"{self._steps})")

    def _copy_pending_blocks(self) -> None:
        bm = self.scheduler.bm
        self.runner.copy_blocks(bm.pending_copies)
        self.runner.copy_states(bm.pending_state_copies)
        bm.pending_copies.clear()
        bm.pending_state_copies.clear()

    # ---- set-up and result ---------------------------------------------------------------------------
    def _requests(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, first: int = 0,
                  seed: int | None = None) -> list[Sequence]:
        """One sequence per run of adjacent identical prompts: prefilled once, then forked. A family never
        outgrows max_num_seqs, the largest batch a decode step (and its graph) holds. `first`: the request index
        of the first prompt (a stream's submissions follow each other), `seed`: the submission's own."""
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        stops = frozenset(sampling.stop_token_ids)
        own = sampling.first_turn_tokens or [None] * len(prompt_token_ids)
        if len(own) != len(prompt_token_ids):
            raise ValueError(f"first_turn_tokens has {len(own)} entries for {len(prompt_token_ids)} prompts")
        limits = [turn_bound(sampling.max_turn_tokens, t) or 0 for t in own]
        parents: list[Sequence] = []
        for i, prompt in enumerate(prompt_token_ids):
            same = parents and prompt_token_ids[i - 1] == prompt and limits[i - 1] == limits[i]
            if same and parents[-1].pending_forks + 1 < self.config.max_num_seqs:
                parents[-1].pending_forks += 1
                continue
            parents.append(Sequence(list(prompt), len(prompt), sampling.max_tokens, stops, request_index=first + i,
                                    turn_limit=limits[i], seed=seed, first_request=first))
        return parents

    def _pool_bytes_held(self) -> int:
        """Bytes of a kept pool, which the next one may reuse."""
        if self.runner is None:
            return 0
        runner = self.runner
        return (runner.k_cache.nbytes * 2 + (runner.states.nbytes if runner.states is not None else 0)
                + (runner.routing.table.nbytes if runner.routing is not None else 0))

    def _bytes_per_slot(self) -> int:
        """A hybrid's state for one sequence, in the pool's dtypes."""
        model, matrices = self.model, self.config.mamba_ssm_cache_dtype
        return bytes_per_slot(model.config, model.compute_dtype(), state_dtype(model, matrices))

    def _prepare_runner(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """Keep a kept pool that is large enough and whose graphs still read the parameters where they are;
        else a new one (parameters move when FSDP gathers them anew, or on a user's model.to())."""
        cfg, runner = self.config, self.runner
        addresses = [p.data_ptr() for p in self.model.parameters()]
        matrices = state_dtype(self.model, cfg.mamba_ssm_cache_dtype)
        if (runner is not None and runner.k_cache.shape[1] >= num_blocks and runner.param_addresses == addresses
                and runner.dtype == cache_dtype(self.model, cfg.kv_cache_dtype)
                and (runner.states is None or (runner.states.num_slots >= num_state_slots
                                               and runner.states.matrix.dtype == matrices))):
            return
        self.runner = None  # the old pool goes before the new one is taken
        # FSDP's gathered parameters are plain tensors for the rollout (models/sharding.py): graphs capture them
        # as they capture a single process's; if the next gather puts them elsewhere, the check above renews them
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.cuda_graphs,
                                  shared_prefix=cfg.shared_prefix, kv_cache_dtype=cfg.kv_cache_dtype,
                                  numerics=cfg.numerics, num_state_slots=num_state_slots,
                                  state_dtype=matrices)
        if cfg.shared_prefix is True and not self.runner.shared_prefix and not self._said_no_shared_prefix:
            self._said_no_shared_prefix = True  # once per engine, not at every rollout
            log.warning("shared_prefix needs the Triton kernels (a CUDA device, a power-of-two head_dim >= 16): "
                        "decoding with the plain attention kernel instead")
        self.runner.param_addresses = addresses

    def _start(self, parents: list[Sequence], sampling: SamplingParams, episodes: bool = False,
               on_finished: Callable[[Turn], None] | None = None, num_blocks: int | None = None,
               state_slots: int = 0) -> None:
        bm = BlockManager(num_blocks or self.runner.k_cache.shape[1], self.config.block_size)
        on_end = None if on_finished is None else (lambda seq: on_finished(as_turn(seq)))
        self.scheduler = Scheduler(bm, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   StopStrings(self.tokenizer, sampling.stop), parks=episodes, on_end=on_end,
                                   before_free=self._keep_routing if self.model.config.is_moe else None,
                                   window=self._release_window(), state_slots=state_slots)
        self._turns_ended: list[Sequence] = []
        self._spawned: list[list[int]] = []  # the prompts of requests a continuation added (`Spawns`), in order
        for seq in parents:
            self.scheduler.add(seq)
        self._sampling = sampling
        self._seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ()).item())
        self._ahead = None  # (sequences, logits) of a decode step launched before the host saw the previous tokens
        self._steps = self._lookahead_steps = 0
        self._waiting_s = 0.0  # episodes: seconds with nothing to compute, waiting for a continuation's reply
        self._replies: list[tuple[float, float]] = []  # episodes: each turn's end and its reply's taking

    def _release_window(self) -> tuple[int, int] | None:
        """(keys, tile) where every attention layer has a sliding window: the blocks before a sequence's window go
        back to the pool as it grows. Not for MoE models, whose routing record lives in the blocks until the end."""
        cfg = self.model.config
        windows = [cfg.window(i) for i in cfg.attention_layers]
        if not windows or None in windows or cfg.is_moe:
            return None
        return max(windows), KEY_TILE

    def _keep_routing(self, seq: Sequence) -> None:
        """Before a finished sequence's blocks go back: the experts that served each position whose output gave a
        completion token's logprob (the prompt's last token through the completion's next-to-last), on the device."""
        bs, start = self.config.block_size, seq.num_prompt_tokens - 1
        slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + seq.num_completion_tokens)]
        seq.routing = self.runner.routing.read(to_device(slots, self.runner.device))

    def _result(self, prompt_token_ids: list[list[int]]) -> RolloutBatch:
        scheduler, bm = self.scheduler, self.scheduler.bm
        self.stats = {"steps": self._steps, "lookahead_steps": self._lookahead_steps,
                      "preemptions": scheduler.num_preemptions, "num_blocks": bm.num_blocks,
                      "prefill_tokens": scheduler.num_prefill_tokens, "waiting_s": self._waiting_s,
                      "mean_reply_ms": 1e3 * sum(b - a for a, b in self._replies) / max(len(self._replies), 1),
                      "replies_pending_s": covered(self._replies)}
        self.scheduler = None
        if bm.num_free != bm.num_blocks:
            raise AssertionError(f"{bm.num_blocks - bm.num_free} KV blocks leaked")
        ordered = [scheduler.finished[i] for i in range(len(prompt_token_ids))]
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_token_ids],
                            completion_ids=[s.completion_token_ids for s in ordered],
                            logprobs=[s.logprobs for s in ordered], finish_reasons=[s.finish_reason for s in ordered],
                            tool_mask=[s.sampled_mask for s in ordered] if scheduler.parks else None,
                            routing=routing_to_host(ordered))
