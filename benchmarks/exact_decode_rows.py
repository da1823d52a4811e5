"""Exact mode's decode attention: the prefill kernel with one query's heads as a program's rows (`decode_rows`), at
32 rows a program (shipped) and at 16, against the default mode's decode kernel. Each exact variant is checked bit
for bit against the training forward's rows for the same queries (the same kernel over whole sequences, in tiles
of 32 queries), and each is timed in a CUDA graph. Whether 16-row programs keep the training forward's bits
decides whether exact decode may take them.

    python3 benchmarks/exact_decode_rows.py [--seqs 64,512] [--context 384]
"""
import argparse

import torch
from decode_kv_dtype import HQ, D, paged_case
from triton.testing import do_bench_cudagraph

from rlcu.engine.paged_attention import decode_rows
from rlcu.kernels.decode_attention import decode_attention_triton
from rlcu.kernels.prefill_attention import BLOCK_M, paged_attention_triton, query_tiles


def timed(run) -> float:
    run()
    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=50) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="64,512")
    p.add_argument("--context", type=int, default=384)
    args = p.parse_args()
    torch.manual_seed(0)
    scale, dev = D ** -0.5, "cuda"
    print("seqs context | default decode us | exact, 32 rows us (training bits) | exact, 16 rows us (training bits)")
    for n in map(int, args.seqs.split(",")):
        _, k, v, table, ctx = paged_case(n, args.context)
        q_all = torch.randn(n * args.context, HQ, D, device=dev, dtype=torch.bfloat16)  # every position's query
        cu = torch.arange(0, n * args.context + 1, args.context, device=dev, dtype=torch.int32)
        training = paged_attention_triton(q_all, k, v, cu, ctx, table, scale, query_tiles(cu.tolist(), BLOCK_M, dev))
        last = cu[1:].long() - 1
        want, q = training[last], q_all[last].contiguous()
        row = [f"{n} {args.context}", f"{timed(lambda: decode_attention_triton(q, k, v, table, ctx, scale)):.1f}"]
        one, tiles = decode_rows(n, dev)
        for block_m in (BLOCK_M, 16):
            def run(block_m=block_m):
                return paged_attention_triton(q, k, v, one, ctx, table, scale, tiles, block_m=block_m,
                                              decode_rows=True)
            row.append(f"{timed(run):.1f} ({torch.equal(run(), want)})")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
