"""Exact mode's decode attention: the prefill kernel with one query's heads as a program's rows (`decode_rows`), at 32
rows on 4 warps, 16 rows on 4 warps and 16 rows on 2 warps (shipped: 16 rows, on 4 warps in 16-bit and on 2 in
fp32), against the default mode's decode kernel. Each exact variant is checked bit for bit against the training
forward's rows for the same queries (the same kernel over whole sequences, in tiles of 32 queries on 4 warps), on
several head shapes and dtypes with contexts of random lengths; each is timed in a CUDA graph on the standard
workload's shape. Whether a variant keeps the training forward's bits decides whether exact decode may take it.

    python3 benchmarks/exact_decode_rows.py [--seqs 64,512] [--context 384]
"""
import argparse

import torch
from decode_kv_dtype import HQ, D, paged_case
from triton.testing import do_bench_cudagraph

from rlcu.engine.paged_attention import decode_rows
from rlcu.kernels.decode_attention import decode_attention_triton
from rlcu.kernels.prefill_attention import paged_attention_triton, query_tiles

VARIANTS = ((32, 4), (16, 4), (16, 2))  # (rows, warps) of a decode program
SHAPES = ((16, 8, 128), (4, 2, 64), (32, 8, 128), (8, 1, 64), (16, 2, 128), (12, 4, 256))  # (Hq, Hkv, head_dim)


def timed(run) -> float:
    run()
    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=50) * 1e3


def bits(hq: int, hkv: int, d: int, dtype: torch.dtype, n: int = 48, bs: int = 16) -> list[int]:
    """For each variant, how many of n sequences' last queries differ from the training forward's rows."""
    g = torch.Generator(device="cuda").manual_seed(hq * 1000 + d)
    ctx = torch.randint(1, 700, (n,), device="cuda", generator=g, dtype=torch.int32)
    per_seq = -(-int(ctx.max()) // bs)
    k = torch.randn(n * per_seq, bs, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(k.shape, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(n * per_seq, device="cuda", dtype=torch.int32, generator=g).view(n, per_seq)
    cu = torch.cat([ctx.new_zeros(1), ctx.cumsum(0)]).to(torch.int32)
    q_all = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype, generator=g)
    training = paged_attention_triton(q_all, k, v, cu, ctx, table, d ** -0.5, query_tiles(cu.tolist(), 32, "cuda"),
                                      block_m=32, num_warps=4)
    last = cu[1:].long() - 1
    want, q = training[last], q_all[last].contiguous()
    one, tiles = decode_rows(n, "cuda")
    out = []
    for rows, warps in VARIANTS:
        got = paged_attention_triton(q, k, v, one, ctx, table, d ** -0.5, tiles, block_m=rows, num_warps=warps,
                                     decode_rows=True)
        out.append(int((got != want).flatten(1).any(1).sum()))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="64,512")
    p.add_argument("--context", type=int, default=384)
    args = p.parse_args()
    torch.manual_seed(0)
    names = " | ".join(f"{r} rows {w} warps" for r, w in VARIANTS)
    print(f"sequences differing from the training forward (of 48), per variant: {names}")
    for hq, hkv, d in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            print(f"Hq {hq} Hkv {hkv} head_dim {d} {str(dtype)[6:]}: {bits(hq, hkv, d, dtype)}", flush=True)
    scale, dev = D ** -0.5, "cuda"
    print(f"seqs context | default decode us | {names} us (training bits)")
    for n in map(int, args.seqs.split(",")):
        _, k, v, table, ctx = paged_case(n, args.context)
        q_all = torch.randn(n * args.context, HQ, D, device=dev, dtype=torch.bfloat16)  # every position's query
        cu = torch.arange(0, n * args.context + 1, args.context, device=dev, dtype=torch.int32)
        training = paged_attention_triton(q_all, k, v, cu, ctx, table, scale, query_tiles(cu.tolist(), 32, dev))
        last = cu[1:].long() - 1
        want, q = training[last], q_all[last].contiguous()
        row = [f"{n} {args.context}", f"{timed(lambda: decode_attention_triton(q, k, v, table, ctx, scale)):.1f}"]
        one, tiles = decode_rows(n, dev)
        for rows, warps in VARIANTS:
            def run(rows=rows, warps=warps):
                return paged_attention_triton(q, k, v, one, ctx, table, scale, tiles, block_m=rows, num_warps=warps,
                                              decode_rows=True)
            row.append(f"{timed(run):.1f} ({torch.equal(run(), want)})")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
