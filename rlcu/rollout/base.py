"""The rollout contract: what the GRPO module asks of any generation backend, and what a backend declares
it can do (`Capabilities`), checked once when the module is built, never guessed from signatures."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from rlcu import plugins
from rlcu.contracts import Continuation, Numerics, Reply, RolloutBatch, SamplingParams, Turn

__all__ = ["Capabilities", "Continuation", "Reply", "RolloutBackend", "RolloutBatch", "RolloutStream", "SamplingParams",
           "Turn", "bind", "capabilities_of", "require", "resolve_rollout"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond `generate(prompt_token_ids, sampling)`; every field defaults to no."""
    continuation: bool = False  # runs multi-turn episodes itself: generate(..., continuation=Continuation)
    on_finished: bool = False  # reports each completion as it ends: generate(..., on_finished=callable(Turn))
    # computes with the trainer's kernels, so sampler logprobs can equal its bits: exact_numerics() says in which
    # (contracts.Numerics, for the trainer to take too), setup(..., numerics=) takes them
    exact_numerics: bool = False
    lora: bool = False  # runs the live model's LoRA adapters (base + adapter, never merged)
    streaming: bool = False  # takes optimizer steps between its decode steps (streaming GRPO)
    # generate(..., should_stop=) looks at should_stop() between decode steps and raises GenerationInterrupted
    interruptible: bool = False
    native_models_only: bool = False  # runs rlcu's native families only (not the transformers fallback)
    # with `continuation`: takes the requests a continuation adds while the rollout runs (`contracts.Spawns`: an agent
    # program's calls that branch), each a row of the batch after the prompts' rows
    spawns: bool = False

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


HELP = {"continuation": "runs multi-turn episodes itself (generate(..., continuation=))",
        "on_finished": "reports each completion as it ends (generate(..., on_finished=))",
        "exact_numerics": "computes with the trainer's own kernels",
        "lora": "runs LoRA adapters", "streaming": "takes optimizer steps between decode steps",
        "interruptible": "stops between decode steps when asked (generate(..., should_stop=))",
        "spawns": "takes the requests a continuation adds while the rollout runs (contracts.Spawns)"}


@runtime_checkable
class RolloutBackend(Protocol):
    """Generation for GRPO. Implementations register under the `rlcu.rollouts` entry-point group and declare
    a class attribute `capabilities = Capabilities(...)` (none when absent)."""

    def setup(self, policy, tokenizer) -> None:
        """Bind to the live model (its parameters are used in place) and its tokenizer (may be None)."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """One completion per prompt. With the `continuation` capability it also takes `continuation=` and runs
        multi-turn episodes itself (else the module runs them turn by turn, `rollout/turns.py`); with
        `on_finished` it takes `on_finished=`, a callable it calls with each request's completion (a `Turn`)
        as soon as that one ends (`score_during_generation`)."""

    def release(self) -> None:
        """Free generation memory (KV cache) before the training phase."""

    # with the `streaming` capability: open_stream(sampling, max_sequences, max_prompt_tokens) -> a RolloutStream
    # with `exact_numerics`: exact_numerics() -> the contracts.Numerics it computes in when exact (EXACT, or
    # EXACT_FP8 over an FP8 KV cache), which the module hands to the trainer and to setup(..., numerics=)

    def on_weights_updated(self) -> None:
        """Called after each optimizer step; backends that share the module's parameters do nothing."""


@runtime_checkable
class RolloutStream(Protocol):
    """A rollout that stays open across optimizer steps (streaming GRPO; rlcu.engine.stream.EngineStream)."""
    version: int  # the policy version the tokens sampled from now on are drawn under
    in_flight: int  # requests submitted and not yet finished

    def submit(self, prompt_token_ids: list[list[int]], seed: int | None) -> int:
        """Queue prompts, drawing from `seed`; returns the first one's request index, the others following."""

    def run(self, until: Callable[[], bool], should_stop: Callable[[], bool] | None = None) -> None:
        """Decode until `until()` or nothing is left; the parameters may change once it returns."""

    def finished(self) -> Mapping[int, object]:
        """Finished requests by index: sequences with token_ids, num_prompt_tokens, completion_token_ids,
        logprobs, versions (one per sampled token) and finish_reason."""

    def pop(self, request: int) -> object: ...

    def take_stats(self) -> tuple[int, float]:
        """(decode steps, mean sequences a step) since the last call."""

    def decode_beside(self, steps: int) -> Any:
        """Up to `steps` decode steps in a worker thread (-1: until `wait()`), on the parameters as they are; the
        returned handle's `wait()` (before the parameters change) returns how many ran. Needed only by
        decode_steps_during_training."""

    def close(self) -> None: ...


def capabilities_of(backend) -> Capabilities:
    caps = getattr(backend, "capabilities", Capabilities())
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{type(backend).__name__}.capabilities must be rlcu.rollout.Capabilities(...), "
                        f"got {type(caps).__name__}")
    return caps


def require(backend, capability: str, wanted_by: str, fix: str) -> None:
    """One error naming the missing capability, the option that needs it and the way out."""
    if not getattr(capabilities_of(backend), capability):
        raise ValueError(f"{wanted_by} needs a rollout backend with the {capability!r} capability (one that "
                         f"{HELP[capability]}); {type(backend).__name__} does not declare it: {fix}")


def bind(backend, policy, tokenizer, numerics: Numerics = Numerics.FAST) -> None:
    """`setup` as the backend declared it: one with `exact_numerics` is told the run's numerics."""
    if capabilities_of(backend).exact_numerics:
        backend.setup(policy, tokenizer, numerics=numerics)
    else:
        backend.setup(policy, tokenizer)


def resolve_rollout(spec) -> RolloutBackend:
    """A backend from an instance, a short name / import path, or {name | class_path, init_args}."""
    backend, _ = plugins.build("rollouts", spec)
    if not isinstance(backend, RolloutBackend):
        raise TypeError(f"{type(backend).__name__} is not a rollout backend: it needs setup(policy, tokenizer), "
                        "generate(prompt_token_ids, sampling), release() and on_weights_updated()")
    capabilities_of(backend)
    return backend
