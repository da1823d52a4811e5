"""The rollout contract: what the GRPO module asks of any generation backend."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


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


@runtime_checkable
class RolloutBackend(Protocol):
    """Generation for GRPO. Implementations register under the `rlcu.rollouts` entry-point group."""

    def setup(self, module) -> None:
        """Bind to a GRPOModule; `module.policy` is the live model whose parameters are used in place."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        ...

    def release(self) -> None:
        """Free generation memory (KV cache) before the training phase."""

    def on_weights_updated(self) -> None:
        """Called after each optimizer step; backends that share the module's parameters do nothing."""
