"""Paged decode attention alone over many batch sizes and two contexts, a bf16 cache (64-token tiles) against an
FP8 one with tiles of 64 and of 128 tokens, each timed in a CUDA graph: where `default_block_n` switches the FP8
tile (16 query / 8 KV heads, head_dim 128, blocks of 16, random block tables: decode_kv_dtype.py's `paged_case`).
    python3 benchmarks/decode_tiles.py"""
import torch
from decode_kv_dtype import HKV, D, paged_case
from triton.testing import do_bench_cudagraph

from rlcu.kernels.decode_attention import decode_attention_triton, default_block_n
from rlcu.kernels.kv_cache import FP8, to_cache


def time_us(q, caches, table, ctx, block_n: int) -> float:
    run = lambda: decode_attention_triton(q, *caches, table, ctx, D ** -0.5, block_n=block_n)  # noqa: E731
    run()
    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=100) * 1e3


def main():
    print("sms", torch.cuda.get_device_properties(0).multi_processor_count)
    for context in (384, 1024):
        for n in (16, 32, 64, 128, 192, 256, 384, 512):
            q, k, v, table, ctx = paged_case(n, context)
            row = [f"ctx={context} seqs={n:4d}"]
            fp8 = (to_cache(k, FP8), to_cache(v, FP8))
            for name, caches, tiles in (("bf16", (k, v), (64,)), ("fp8", fp8, (64, 128))):
                nbytes = 2 * caches[0].numel() * caches[0].element_size()
                for block_n in tiles:
                    us = time_us(q, caches, table, ctx, block_n)
                    row.append(f"{name}/{block_n} {us:6.1f}us {nbytes / us / 1e6:4.2f}TB/s")
            row.append(f"default_fp8={default_block_n(n, HKV, True)}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
