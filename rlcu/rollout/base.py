"""The rollout contract: what the GRPO module asks of any generation backend."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlcu.contracts import Continuation, Reply, RolloutBatch, SamplingParams, Turn

__all__ = ["Continuation", "Reply", "RolloutBackend", "RolloutBatch", "SamplingParams", "Turn"]


@runtime_checkable
class RolloutBackend(Protocol):
    """Generation for GRPO. Implementations register under the `rlcu.rollouts` entry-point group."""

    def setup(self, module) -> None:
        """Bind to a GRPOModule; `module.policy` is the live model whose parameters are used in place."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """One completion per prompt. A backend may also take `continuation=` (a `Continuation`) and run
        multi-turn episodes itself; for one that does not, the module runs them turn by turn
        (`rollout/turns.py`). It may also take `on_finished=`, a callable it calls with each request's
        completion (a `Turn`) as soon as that one ends, so that the module scores finished completions while
        the rest decode (`score_during_generation`); for one that does not, scoring waits for the rollout."""

    def release(self) -> None:
        """Free generation memory (KV cache) before the training phase."""

    def on_weights_updated(self) -> None:
        """Called after each optimizer step; backends that share the module's parameters do nothing."""
