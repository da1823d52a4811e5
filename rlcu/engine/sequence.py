"""A sequence: one prompt plus its growing completion, and where its KV lives in the paged cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count

_ids = count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
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
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    pending_forks: int = 0  # samples still to fork from this sequence once its prompt is prefilled

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

    def append(self, token: int, logprob: float) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_completion_tokens >= self.max_tokens:
            self.finish_reason = "length"

    def fork(self) -> "Sequence":
        """A sibling sharing everything computed so far (the caller shares the blocks)."""
        return Sequence(list(self.token_ids), self.num_prompt_tokens, self.max_tokens, self.stop_token_ids,
                        self.request_index, status=self.status, block_table=list(self.block_table),
                        num_computed_tokens=self.num_computed_tokens, logprobs=list(self.logprobs))
