"""Paged decode attention alone on the standard workload's shape (16 query / 8 KV heads, head_dim 128, blocks of
16, random block tables), at the mean context of a 128 + 512 rollout (or `--context`: 2176 is that of 128 + 4096):
a bf16 cache against an FP8 one, over tiles of 64 and 128 tokens, 4 and 8 warps, 3-6 pipeline stages and 1-8
splits of each sequence. Prints the default launch, the fastest few and the fastest of each split count for each
cache dtype, with the KV bytes read per second, each timed in a CUDA graph (as the engine runs it: at 64 sequences
the host's launch would take longer than the kernel).
    python3 benchmarks/decode_kv_dtype.py [SEQUENCES ...] [--context TOKENS]"""
import argparse
import itertools

import torch
from triton.testing import do_bench_cudagraph

from rlcu.kernels.decode_attention import decode_attention_triton, default_block_n
from rlcu.kernels.kv_cache import FP8, to_cache

HQ, HKV, D, BS, CTX = 16, 8, 128, 16, 384
# Triton double-buffers the gathered tiles only from 5 stages on (below that, one buffer: each tile's load waits for
# the last tile's arithmetic), so the sweep reaches 6
GRID = dict(block_n=(64, 128), num_warps=(4, 8), num_stages=(3, 4, 5, 6), num_splits=(1, 2, 4, 8))


def paged_case(n: int, context: int = CTX):
    """q [n, HQ, D], bf16 K and V caches in blocks of BS with random block tables, and every context at `context`."""
    blocks = n * context // BS
    k = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(n, context // BS)
    ctx = torch.full((n,), context, dtype=torch.int32, device="cuda")
    return torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16), k, v, table, ctx


def main(sizes, context: int = CTX):
    for n in sizes:
        q, k, v, table, ctx = paged_case(n, context)
        for name, caches in (("bf16", (k, v)), ("fp8", (to_cache(k, FP8), to_cache(v, FP8)))):
            default_n = default_block_n(n, HKV, name == "fp8")
            want = decode_attention_triton(q, *caches, table, ctx, D ** -0.5).float()
            gb = 2 * n * context * HKV * D * caches[0].element_size() / 1e9
            default = dict(block_n=default_n, num_warps=4, num_stages=3, num_splits=None)
            timed = []
            for values in [tuple(default.values())] + list(itertools.product(*GRID.values())):
                launch = dict(zip(GRID, values))
                run = lambda: decode_attention_triton(q, *caches, table, ctx, D ** -0.5, **launch)  # noqa: E731
                try:
                    gap = (run().float() - want).abs().max().item()
                    timed.append((do_bench_cudagraph(run, rep=40), gap, launch))
                except Exception as error:  # a launch past the shared memory or registers of the GPU
                    print(f"{n:4d} seqs  {name}: {launch} failed: {type(error).__name__}", flush=True)
            first = timed[0]
            by_splits: dict[int, tuple] = {}  # the fastest launch of each split count, in the grid's order
            for t in timed[1:]:
                splits = t[2]["num_splits"]
                if splits not in by_splits or t[0] < by_splits[splits][0]:
                    by_splits[splits] = t
            fastest = sorted(timed, key=lambda t: t[0])[:5]
            rows = [("default", first)] + [("best", t) for t in fastest] + [("splits", t) for t in by_splits.values()]
            for label, (ms, gap, launch) in rows:
                print(f"{n:4d} seqs  {name:4s} {label:7s} {1e3 * ms:7.1f} us  {gb / ms * 1e3:6.0f} GB/s  "
                      f"|diff| from the default {gap:.1e}  {launch}", flush=True)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("sequences", type=int, nargs="*", default=[64, 512])
    cli.add_argument("--context", type=int, default=CTX, help=f"tokens of KV per sequence (default {CTX})")
    args = cli.parse_args()
    main(args.sequences, args.context)
