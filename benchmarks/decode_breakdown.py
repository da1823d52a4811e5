"""Where a decode step's time goes, on the standard workload's model: the whole engine step, the graph
replay alone (GPU), paged attention alone, sampling alone, and the kernels of an eager step by CUDA time.
    python3 benchmarks/decode_breakdown.py [SEQUENCES ...]"""
import sys
import time

import torch

from rlcu.bench import random_model, random_prompt_ids
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.kernels.decode_attention import decode_attention
from rlcu.kernels.sampling import sample
from rlcu.rollout.base import SamplingParams


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main(sizes):
    model, _ = random_model("cuda", torch.bfloat16)
    model.eval()
    cfg = model.config
    for n in sizes:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=max(256, n), release_memory=False))
        prompts = random_prompt_ids(n, 128, cfg.vocab_size, seed=n)
        sp = SamplingParams(max_tokens=256, temperature=1.0, seed=0)
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        step = (time.perf_counter() - t) / engine.stats["steps"] * 1e3
        graphs = engine.runner.graphs
        graph, _ = next(v for k, v in graphs.graphs.items() if k[0] >= n)
        replay = timed(graph.replay)
        q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        ctx = torch.full((n,), 256, dtype=torch.int32, device="cuda")
        tables = graphs.block_tables[:n]
        kc, vc = engine.runner.k_cache[0], engine.runner.v_cache[0]
        attn = timed(lambda: decode_attention(q, kc, vc, tables, ctx, cfg.head_dim ** -0.5)) * cfg.num_hidden_layers
        logits = torch.randn(n, cfg.vocab_size, device="cuda")
        seeds = torch.arange(n, device="cuda")  # per-row seeds: the engine's Triton sampler
        samp = timed(lambda: sample(logits, 1.0, 0, 1.0, 0.0, seeds=seeds))
        kv_bytes = n * 256 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
        print(f"n={n}: engine step {step:.2f} ms | graph replay {replay:.2f} ms | attention x{cfg.num_hidden_layers} "
              f"{attn:.2f} ms ({kv_bytes / (attn / 1e3) / 1e9:.0f} GB/s of KV at ctx 256) | sampling {samp:.2f} ms | "
              f"host and the rest {step - replay - samp:.2f} ms", flush=True)
        engine.release(force=True)
    eager = LLMEngine(model, EngineConfig(cuda_graphs=False, max_num_seqs=max(256, sizes[-1])))
    prompts = random_prompt_ids(sizes[-1], 128, cfg.vocab_size)
    eager.generate(prompts, SamplingParams(max_tokens=4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eager.generate(prompts, SamplingParams(max_tokens=16))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [64, 512])
