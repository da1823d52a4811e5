"""A sequence: one prompt plus its growing completion, and where its KV lives in the paged cache.

In an episode (a rollout with a continuation) the completion grows in turns: the model samples until a
stop or the turn's length, then the continuation appends tokens it did not sample (a tool's result, an
environment's message), which `appended` records so they can be masked out of the loss."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count

_ids = count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    PARKED = auto()  # a turn ended: its KV stays in the pool while the continuation decides what comes next
    FINISHED = auto()


@dataclass(eq=False)  # identity: the scheduler removes sequences from lists, which compares them
class Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    request_index: int  # position of this completion in the caller's request list
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    released: int = 0  # block_table's first entries given back, outside every layer's window (`BlockManager.RELEASED`)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    pending_forks: int = 0  # samples still to fork from this sequence once its prompt is prefilled
    turn_limit: int = 0  # completion tokens at which the current turn ends ("length"); 0: max_tokens
    appended: list[tuple[int, int]] = field(default_factory=list)  # [start, end) completion spans not sampled
    versions: list[int] = field(default_factory=list)  # the policy version each sampled token was drawn under
    # a stream's requests draw from their own submission's seed, numbered from its first request, as they would
    # in a rollout of that submission alone (None: the rollout's seed, numbered from 0)
    seed: int | None = None
    first_request: int = 0
    routing: object = None  # a finished MoE sequence's routing record on the device (`engine/routing.py`)
    # a hybrid's recurrent-state slot (`engine/states.py`), taken at admission with its forks' and kept until it ends
    state_slot: int | None = None
    fork_slots: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.turn_limit = min(self.turn_limit or self.max_tokens, self.max_tokens)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append(self, token: int, logprob: float, version: int = 0) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_completion_tokens >= self.turn_limit:
            self.finish_reason = "length"

    def extend(self, token_ids: list[int], max_turn_tokens: int | None) -> None:
        """Append tokens the model did not sample and open its next turn (of at most `max_turn_tokens`)."""
        start = self.num_completion_tokens  # the caller checked the room (contracts.check_reply)
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.appended.append((start, start + len(token_ids)))
        end = self.num_completion_tokens
        self.turn_limit = self.max_tokens if max_turn_tokens is None else min(self.max_tokens, end + max_turn_tokens)
        self.finish_reason = None

    @property
    def sampled_mask(self) -> list[int]:
        """1 for each completion token the model sampled, 0 for appended ones (TRL's `tool_mask`)."""
        mask = [1] * self.num_completion_tokens
        for start, end in self.appended:
            mask[start:end] = [0] * (end - start)
        return mask

    def fork(self) -> "Sequence":
        """A sibling sharing everything computed so far (the caller shares the blocks)."""
        return Sequence(list(self.token_ids), self.num_prompt_tokens, self.max_tokens, self.stop_token_ids,
                        self.request_index, status=self.status, block_table=list(self.block_table),
                        released=self.released, num_computed_tokens=self.num_computed_tokens,
                        logprobs=list(self.logprobs),
                        turn_limit=self.turn_limit, appended=list(self.appended), versions=list(self.versions),
                        seed=self.seed, first_request=self.first_request)

    def draw_key(self, seed: int) -> tuple[int, int, int]:
        """What the next token's random draw depends on: (seed, request within its submission, token index)."""
        own = self.seed if self.seed is not None else seed
        return own, self.request_index - self.first_request, self.num_completion_tokens
