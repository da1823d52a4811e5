"""What the layers hand each other: the sampling request (`SamplingParams`), its answer (`RolloutBatch`),
stop handling (EOS ids, stop strings), and the turn protocol of multi-turn episodes (`Turn`, `Reply`,
`Continuation`). A leaf module, so that the engine, the rollout backends, the agents and the GRPO module
share these types without importing each other."""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def eos_token_ids(config, tokenizer) -> list[int]:
    """Every end-of-sequence id the model's config or its tokenizer declares: a completion stops at any."""
    ids = set(config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class StopStrings:
    def __init__(self, tokenizer, stops: list[str]):
        if stops and tokenizer is None:
            raise ValueError("stop strings need the tokenizer: the backend was set up without one")
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        # enough tokens to spell the longest stop string (every token spells at least one character),
        # plus one more for a token that straddles its start
        self.window = max((len(s) for s in self.stops), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, completion_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(completion_ids[-self.window:], skip_special_tokens=False)
        return any(s in tail for s in self.stops)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (the completion keeps the tokens that spell them)
    seed: int | None = None
    # episodes: max_tokens bounds the whole completion (every turn and every appended token); this bounds
    # each turn the model samples (None: only max_tokens)
    max_turn_tokens: int | None = None
    # episodes: each request's own bound on its first turn, within max_turn_tokens (None, or a None entry: only
    # max_turn_tokens); an agent program's first call with its own `max_tokens`
    first_turn_tokens: list[int | None] | None = None
    # > 1 discourages every token already in the sequence, prompt included (vLLM's and transformers' meaning): its
    # logit is divided by the penalty where positive, multiplied where negative; 1.0: off
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 or None, got {self.max_turn_tokens}")
        if any(t is not None and t < 1 for t in self.first_turn_tokens or ()):
            raise ValueError("first_turn_tokens entries must be >= 1 or None")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError(f"top_k must be >= 0 and min_p in [0, 1], got top_k={self.top_k}, min_p={self.min_p}")


class Numerics(str, Enum):
    """How the sampler and the trainer compute, chosen once per run (`exact_logprobs`) and handed to the engine
    (`EngineConfig.numerics`) and to the training log-probabilities as a value: FAST lets each side take its
    fastest kernels (their logprobs differ in the last bits); EXACT runs both through batch-invariant GEMMs and
    one attention kernel, so the sampler's logprob of a token equals the trainer's to the bit (docs/engine.md).
    EXACT_FP8 is EXACT over the engine's FP8 KV cache: the training forward's attention reads its keys and values
    rounded to e4m3 as the cache holds them."""
    FAST = "fast"
    EXACT = "exact"
    EXACT_FP8 = "exact_fp8"

    @property
    def batch_invariant(self) -> bool:
        return self is not Numerics.FAST

    @property
    def kv_cache_dtype(self) -> str:
        """The engine's `kv_cache_dtype` these numerics assume on both sides ("auto": the forward's dtype)."""
        return "fp8" if self is Numerics.EXACT_FP8 else "auto"

    @classmethod
    def exact(cls, kv_cache_dtype: str = "auto") -> "Numerics":
        """The exact numerics over an engine cache of `kv_cache_dtype`."""
        return cls.EXACT_FP8 if kv_cache_dtype.startswith("fp8") else cls.EXACT


@dataclass
class RolloutBatch:
    """One completion per prompt row. `completion_ids` include the stop token when one was sampled;
    `logprobs[i][j]` is the sampler's log softmax(logits / temperature) of `completion_ids[i][j]` (NaN from a
    backend that cannot score its samples: the sampler correction then treats them as the trainer's).
    In episodes the completion holds every turn and the tokens appended between them; `tool_mask[i][j]`
    (TRL's name) is 1 where the model sampled the token and 0 where a continuation appended it (logprob
    0.0 there). Without a continuation `tool_mask` is None: every token was sampled."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (a stop token was sampled) or "length" (max_tokens reached)
    tool_mask: list[list[int]] | None = None
    # a mixture-of-experts model's routing, where the backend records it: routing[i][j] ([MoE layers, k] int16) are
    # the experts each MoE layer picked at the position whose output gave completion_ids[i][j]'s logprob
    routing: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def __post_init__(self):
        n = len(self.prompt_ids)
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.finish_reasons) == n):
            raise ValueError("RolloutBatch fields must have one entry per prompt row")
        if self.tool_mask is not None and [len(m) for m in self.tool_mask] != [len(c) for c in self.completion_ids]:
            raise ValueError("RolloutBatch.tool_mask must have one entry per completion token")
        if self.routing is not None and [len(r) for r in self.routing] != [len(c) for c in self.completion_ids]:
            raise ValueError("RolloutBatch.routing must have one entry per completion token")


@dataclass
class Turn:
    """A turn that ended, as a rollout backend hands it to the continuation."""
    request: int  # the row of the request list
    completion_ids: list[int]  # the episode so far: every turn and every appended token
    finish_reason: str  # the turn's: "stop" or "length" (max_tokens or max_turn_tokens reached)
    logprobs: list[float] | None = None  # the sampler's logprob of each completion token (0.0 where appended)


@dataclass
class Reply:
    """The continuation's answer: tokens to append (prefilled, not sampled) before the model's next turn,
    or, with `token_ids` None, the end of the episode."""
    token_ids: list[int] | None = None
    finish_reason: str | None = None  # when the episode ends: its reason (None: the last turn's)
    max_turn_tokens: int | None = None  # the next turn's own bound, within the rollout's (None: the rollout's)


def turn_bound(rollout: int | None, own: int | None) -> int | None:
    """A turn's bound: the smaller of the rollout's (max_turn_tokens) and the request's own, None where neither."""
    return own if rollout is None else rollout if own is None else min(rollout, own)


def check_reply(reply, completion_length: int, max_tokens: int) -> None:
    """What every backend asks of a continuation's reply: a `Reply`, and tokens that leave room to sample."""
    if not isinstance(reply, Reply):
        raise TypeError(f"a continuation must return a Reply, got {type(reply).__name__}")
    if reply.token_ids is None:
        return
    if not reply.token_ids:
        raise ValueError("a continuation replied with no tokens: reply Reply(None) to end the episode")
    if completion_length + len(reply.token_ids) >= max_tokens:
        raise ValueError(f"appending {len(reply.token_ids)} tokens to a completion of {completion_length} leaves no "
                         f"room to sample within max_tokens={max_tokens}; end the episode instead")


# Called from worker threads, one call per ended turn, so that a slow tool does not hold up the decoding
# of other episodes; calls for different requests may run at the same time. A continuation whose calls wait on
# someone else (an agent program's next request) declares how many may wait at once as an int attribute
# `waiting_turns`; backends run at least that many at once (`continuation_workers`). A continuation that adds
# requests while the rollout runs (an agent program's calls that branch) declares them as an attribute `spawns`, a
# `Spawns`; only a backend with the `spawns` capability takes them (`continuation_spawns`). A continuation whose
# replies wait on someone else may answer later instead: it declares `replies_later = True`, and each call returns at
# once a `concurrent.futures.Future` of its Reply, so that no thread waits for it (`reply_of`).
Continuation = Callable[[Turn], Reply]


def replies_later(continuation: Continuation | None) -> bool:
    """Whether the continuation's calls return a Future of their Reply (it declares `replies_later = True`)."""
    later = getattr(continuation, "replies_later", False)
    if not isinstance(later, bool):
        raise TypeError(f"{type(continuation).__name__}.replies_later must be True or False, got {later!r}")
    return later


def reply_of(continuation: Continuation, turn: Turn) -> Reply:
    """The continuation's Reply to `turn`, waited for where it replies later (on a backend's worker thread)."""
    if not replies_later(continuation):
        return continuation(turn)
    return later_reply(continuation(turn), continuation).result()


def later_reply(future, continuation: Continuation) -> Future:
    if not isinstance(future, Future):
        raise TypeError(f"{type(continuation).__name__} replies later, so it must return a "
                        f"concurrent.futures.Future of its Reply, got {type(future).__name__}")
    return future


class RolloutEnded(RuntimeError):
    """A request was added to a rollout's `Spawns` after the rollout ended."""


class Spawns:
    """The requests a continuation adds while its rollout runs: each is numbered after the rollout's own prompts
    (from `first`, in the order added) and runs as one more episode of the same rollout, whose `RolloutBatch` then
    has a row for it after the prompts' rows. At most `capacity` requests of at most `max_prompt_tokens` each, so
    that the backend can size its memory before the first one comes. `add` runs on any thread; the backend takes
    them between its decode steps and closes the queue when its rollout ends."""

    def __init__(self, first: int, capacity: int, max_prompt_tokens: int):
        self.first, self.capacity, self.max_prompt_tokens = first, capacity, max_prompt_tokens
        self._lock = threading.Lock()
        self._queue: list[tuple[int, list[int], int | None]] = []
        self._added, self._closed = 0, False
        # set when a request waits to be taken: a backend with nothing else to do waits on it
        self.arrived: Future = Future()

    def add(self, prompt_ids: list[int], first_turn_tokens: int | None = None) -> int:
        """Queue one request (its prompt and its first turn's own bound); returns its request index."""
        if not prompt_ids or len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"a spawned request needs 1 to {self.max_prompt_tokens} prompt tokens, got "
                             f"{len(prompt_ids)}")
        with self._lock:
            if self._closed:
                raise RolloutEnded("the rollout has ended: it takes no more requests")
            if self._added >= self.capacity:
                raise ValueError(f"the rollout takes at most {self.capacity} spawned requests")
            index = self.first + self._added
            self._added += 1
            self._queue.append((index, list(prompt_ids), first_turn_tokens))
            if not self.arrived.done():
                self.arrived.set_result(True)
        return index

    def take(self) -> list[tuple[int, list[int], int | None]]:
        """The requests added since the last take: (request index, prompt ids, first turn's own bound)."""
        with self._lock:
            taken, self._queue = self._queue, []
            if self.arrived.done():
                self.arrived = Future()
        return taken

    def close(self, drop: bool = False) -> bool:
        """End the rollout's intake, unless a request is waiting to be taken (then False: take it and run it);
        `drop`: end it whatever waits (a rollout that failed)."""
        with self._lock:
            if self._queue and not drop:
                return False
            self._queue = []
            self._closed = True
            return True


def continuation_spawns(continuation: Continuation | None) -> Spawns | None:
    """The requests a continuation declares it may add while the rollout runs (its `spawns`), or None."""
    spawns = getattr(continuation, "spawns", None)
    if spawns is not None and not isinstance(spawns, Spawns):
        raise TypeError(f"{type(continuation).__name__}.spawns must be rlcu.contracts.Spawns or None, got "
                        f"{type(spawns).__name__}")
    return spawns


def continuation_workers(continuation: Continuation, default: int) -> int:
    """Threads for a continuation's calls: `default` (a tool's or an environment's turn is short), or as many
    turns as it declares may wait at once, so that no ended turn queues behind turns that wait."""
    waiting = getattr(continuation, "waiting_turns", 0)
    if not isinstance(waiting, int) or isinstance(waiting, bool) or waiting < 0:
        raise TypeError(f"{type(continuation).__name__}.waiting_turns must be a non-negative int, got {waiting!r}")
    return max(default, waiting)


@dataclass
class TrainerState(Mapping):
    """What TRL hands rewards as `trainer_state` (transformers' `TrainerState`): read as attributes
    (`trainer_state.global_step`, as TRL documents) or as a mapping (`trainer_state["global_step"]`)."""
    global_step: int = 0
    max_steps: int = -1  # -1: no step limit (the run ends by epochs or time)
    epoch: float = 0.0
    num_train_epochs: int = -1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    def __getitem__(self, key: str):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


class GenerationInterrupted(RuntimeError):
    """The run asked to stop (SIGTERM, Ctrl-C) while a rollout was decoding: the rollout ends between two of its
    decode steps, and its completions are dropped (the weights are still the last finished step's)."""
