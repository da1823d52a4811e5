"""How many KV blocks a rollout's pool gets: what can be held at once, within a memory budget.

The bound is the smaller of two counts, then capped by memory:
- everything at once: each prompt's full blocks once for its family (forks share them), plus each
  sample's own blocks for the rest of its prompt and its completion;
- what can run at once: `max_num_seqs` running sequences and the one prefill chunk in progress, each at
  its longest. A pool of this size never makes the scheduler preempt for want of blocks;
- memory: `memory_fraction` of the device's free memory (on the CPU, of the memory available), plus a
  pool this engine already holds. Where this cap bites, the scheduler preempts and recomputes."""
from __future__ import annotations

import os

import torch

from rlcu.engine.block_manager import blocks_for
from rlcu.engine.paged_attention import cache_dtype
from rlcu.engine.routing import bytes_per_token as routing_bytes_per_token
from rlcu.engine.sequence import Sequence
from rlcu.models.decoder import CausalLM


def bytes_per_block(model: CausalLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
    cfg = model.config
    size = torch.empty((), dtype=cache_dtype(model, kv_cache_dtype)).element_size()
    kv = 2 * len(cfg.attention_layers) * cfg.num_key_value_heads * cfg.head_dim * size
    return block_size * (kv + routing_bytes_per_token(cfg))


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def blocks_all_at_once(parents: list[Sequence], block_size: int) -> int:
    total = 0
    for s in parents:
        longest = blocks_for(s.num_prompt_tokens + s.max_tokens, block_size)
        shared = s.num_prompt_tokens // block_size  # full prompt blocks; a partial one is copied on write
        total += shared + (1 + s.pending_forks) * (longest - shared)
    return total


def blocks_running_at_once(parents: list[Sequence], block_size: int, max_num_seqs: int) -> int:
    longest = max(blocks_for(s.num_prompt_tokens + s.max_tokens, block_size) for s in parents)
    return (max_num_seqs + 1) * longest


def pool_size(parents: list[Sequence], config, model: CausalLM, held_bytes: int = 0, state_bytes: int = 0,
              spawned: tuple[int, int] = (0, 0)) -> int:
    """Blocks for a rollout of `parents` (sequences with their pending forks) under `config` (EngineConfig), beside
    `state_bytes` of recurrent state (a hybrid's, `states.py`), which comes out of the same budget first. `spawned`:
    (how many, prompt tokens each at most) of the requests a continuation may add as the rollout runs."""
    bs = config.block_size
    want = config.num_blocks
    if want is None:
        count, prompt = spawned
        longest = [Sequence([0] * prompt, prompt, parents[0].max_tokens, frozenset(), -1)] if count else []
        want = min(blocks_all_at_once(parents, bs) + count * blocks_for(prompt + parents[0].max_tokens, bs),
                   blocks_running_at_once(parents + longest, bs, config.max_num_seqs))
    budget = int((available_memory(model.device) + held_bytes) * config.memory_fraction) - state_bytes
    if budget <= 0:
        raise ValueError(f"the recurrent state of {sum(1 + s.pending_forks for s in parents)} sequences "
                         f"({state_bytes / 2**30:.1f} GiB) does not fit in memory_fraction={config.memory_fraction} "
                         "of free memory: raise memory_fraction or generate fewer sequences at once")
    per_block = bytes_per_block(model, bs, config.kv_cache_dtype)
    if per_block == 0:  # no attention layer (a hybrid of linear-attention layers only): blocks cost nothing
        return max(1, want)
    blocks = max(1, min(want, budget // per_block))
    # tensor parallelism: every rank's scheduler must take the same steps (each one's forwards are collectives)
    tp = getattr(model, "tensor_parallel", None)
    return blocks if tp is None else tp.agree(blocks)
