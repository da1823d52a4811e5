"""The native rollout backend: rlcu's paged-KV engine running the module's own parameters in place."""
from __future__ import annotations

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.rollout.base import RolloutBatch, SamplingParams


class NativeRollout:
    def __init__(self, block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 memory_fraction: float = 0.5, num_blocks: int | None = None, cuda_graphs: bool = True,
                 release_memory: bool = True, lookahead: bool = True, shared_prefix: bool | None = None):
        """`release_memory=False` keeps the KV pool and CUDA graphs between rollouts: faster steps (no
        re-allocation, no graph capture) for the price of that memory during training. `lookahead`,
        `shared_prefix`: see `EngineConfig`."""
        self.config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, memory_fraction=memory_fraction,
                                   num_blocks=num_blocks, cuda_graphs=cuda_graphs, release_memory=release_memory,
                                   lookahead=lookahead, shared_prefix=shared_prefix)
        self.engine: LLMEngine | None = None

    @property
    def model(self):
        return None if self.engine is None else self.engine.model

    def setup(self, module) -> None:
        self.engine = LLMEngine(module.policy, self.config, tokenizer=getattr(module, "tokenizer", None))

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        if self.engine is None:
            raise RuntimeError("NativeRollout.generate() called before setup(module)")
        return self.engine.generate(prompt_token_ids, sampling)

    def release(self) -> None:
        if self.engine is not None:
            self.engine.release()

    def on_weights_updated(self) -> None:
        pass  # the engine reads the module's parameters in place: nothing to sync
