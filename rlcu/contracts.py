"""What the layers hand each other: the sampling request (`SamplingParams`), its answer (`RolloutBatch`),
and stop handling (EOS ids, stop strings). A leaf module, so that the engine, the rollout backends and
the GRPO module share these types without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError(f"top_k must be >= 0 and min_p in [0, 1], got top_k={self.top_k}, min_p={self.min_p}")


@dataclass
class RolloutBatch:
    """One completion per prompt row. `completion_ids` include the stop token when one was sampled;
    `logprobs[i][j]` is the sampler's log softmax(logits / temperature) of `completion_ids[i][j]`."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (a stop token was sampled) or "length" (max_tokens reached)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def __post_init__(self):
        n = len(self.prompt_ids)
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.finish_reasons) == n):
            raise ValueError("RolloutBatch fields must have one entry per prompt row")
