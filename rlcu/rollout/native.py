"""The native rollout backend: rlcu's paged-KV engine running the module's own parameters in place."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

from rlcu.contracts import Continuation, Numerics, RolloutBatch, SamplingParams, Turn
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.engine.stream import EngineStream
from rlcu.rollout.base import Capabilities


class NativeRollout:
    capabilities = Capabilities(continuation=True, on_finished=True, exact_numerics=True, lora=True,
                                interruptible=True, native_models_only=True, streaming=True,
                                spawns=True)

    def __init__(self, engine: EngineConfig | dict | None = None):
        """`engine`: the engine's settings (`EngineConfig`, or its fields as a mapping, as YAML gives them:
        `rollout: {name: native, init_args: {engine: {block_size: 16}}}`). `release_memory=False` keeps the
        KV pool and CUDA graphs between rollouts: faster steps (no re-allocation, no graph capture) for the
        price of that memory during training."""
        if isinstance(engine, dict):
            if "numerics" in engine:  # one definition: the module's option, which setup() hands the engine
                raise ValueError("the engine's numerics come from the module: set exact_logprobs (model.exact_logprobs "
                                 "in YAML), not rollout.init_args.engine.numerics")
            fields = set(asdict(EngineConfig())) - {"numerics"}
            unknown = sorted(set(engine) - fields)
            if unknown:
                raise ValueError(f"unknown engine setting(s) {unknown} for the native rollout; "
                                 f"settings: {sorted(fields)}")
            engine = EngineConfig(**engine)
        self.config = engine or EngineConfig()
        self.engine: LLMEngine | None = None

    @property
    def model(self):
        return None if self.engine is None else self.engine.model

    def exact_numerics(self) -> Numerics:
        """The exact numerics of this engine's KV cache (`exact_numerics` capability): EXACT_FP8 over an FP8 one."""
        return Numerics.exact(self.config.kv_cache_dtype)

    def setup(self, policy, tokenizer=None, numerics: Numerics = Numerics.FAST) -> None:
        """`numerics` (the exact_numerics capability): EXACT decodes with the trainer's kernels."""
        self.engine = LLMEngine(policy, replace(self.config, numerics=numerics), tokenizer=tokenizer)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 continuation: Continuation | None = None,
                 on_finished: Callable[[Turn], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> RolloutBatch:
        """Completions; with a `continuation`, episodes whose KV stays in the pool between turns; `on_finished`
        hears of each completion as it ends; `should_stop` is asked between decode steps (`LLMEngine.generate`)."""
        if self.engine is None:
            raise RuntimeError("NativeRollout.generate() called before setup(policy, tokenizer)")
        return self.engine.generate(prompt_token_ids, sampling, continuation, on_finished, should_stop)

    def open_stream(self, sampling: SamplingParams, max_sequences: int, max_prompt_tokens: int) -> EngineStream:
        """The `streaming` capability: a rollout that stays open between optimizer steps (engine/stream.py)."""
        if self.engine is None:
            raise RuntimeError("NativeRollout.open_stream() called before setup(policy, tokenizer)")
        return EngineStream(self.engine, sampling, max_sequences, max_prompt_tokens)

    def release(self) -> None:
        if self.engine is not None:
            self.engine.release()

    def on_weights_updated(self) -> None:
        pass  # the engine reads the module's parameters in place: nothing to sync
