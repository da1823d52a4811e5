"""Paged decode attention alone on the standard workload's shape (16 query / 8 KV heads, head_dim 128, blocks of
16): a bf16 cache against an FP8 one, tiles of 64 and 128 tokens, at the mean context of a
128 + 512 rollout. Prints the kernel's time and the KV bytes it reads per second.
    python3 benchmarks/decode_kv_dtype.py [SEQUENCES ...]"""
import sys

import torch
from triton.testing import do_bench

from rlcu.kernels.decode_attention import decode_attention_triton
from rlcu.kernels.kv_cache import FP8, to_cache

HQ, HKV, D, BS, CTX = 16, 8, 128, 16, 384


def main(sizes):
    for n in sizes:
        blocks = n * CTX // BS
        k = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(n, CTX // BS)
        ctx = torch.full((n,), CTX, dtype=torch.int32, device="cuda")
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        k8, v8 = to_cache(k, FP8), to_cache(v, FP8)
        want = decode_attention_triton(q, k8, v8, table, ctx, D ** -0.5, block_n=64).float()
        for name, caches in (("bf16", (k, v)), ("fp8", (k8, v8))):
            for block_n in (64, 128):
                run = lambda: decode_attention_triton(q, *caches, table, ctx, D ** -0.5, block_n=block_n)  # noqa: E731
                gap = (run().float() - want).abs().max().item() if name == "fp8" else float("nan")
                ms = do_bench(run, warmup=25, rep=200)
                gb = 2 * n * CTX * HKV * D * caches[0].element_size() / 1e9
                print(f"{n:4d} seqs  {name:4s} block_n {block_n:3d}: {1e3 * ms:7.1f} us  {gb / ms * 1e3:6.0f} GB/s  "
                      f"(fp8 |diff| from block_n 64: {gap:.1e})", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 512])
