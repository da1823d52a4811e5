"""The native rollout engine: paged KV cache, continuous batching, prefix sharing across a prompt's
G samples, on the module's own parameters (nano-vllm's shape: sequence, block_manager, scheduler,
model_runner, llm_engine)."""
