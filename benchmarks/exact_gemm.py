"""Exact mode's GEMM (rlcu/kernels/matmul.py) over tile configurations, against cuBLAS, on one GPU.

For each (M, N, K) of the Qwen3-0.6B and 1.7B layers, every configuration's time inside a CUDA graph (launch
cost out, as in the engine's decode) and whether its output has the same bits as the shipped configuration's.
Same bits for every configuration with the same K walk would let the tiles follow M without breaking batch
invariance (each row's sums are the same k16 steps in the same order whatever the tile).

    python3 benchmarks/exact_gemm.py [--quick]
    python3 benchmarks/exact_gemm.py --training 8192,32768   # training's rows: row tiles grouped or not
"""
import argparse
import itertools
import json
import time

import torch
from triton.testing import do_bench_cudagraph

from rlcu.kernels import matmul
from rlcu.kernels.matmul import BLOCK_K, BLOCK_M, GROUP_M, block_n

LAYERS = {  # (N, K): qkv, o, gate_up, down, lm_head
    "0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)],
    "1.7b": [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144)],
}


def launch(x, w, y, bm, bn, bk, warps, stages, group_m=GROUP_M):
    matmul.launch(x, w, None, y, bm, bn, bk, warps, stages, group_m)
    return y


TRAINING_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                  (128, 128, 128, 8, 3), (64, 256, 64, 4, 4)]


def training_rows(rows: list[int]) -> None:
    """A training forward's many rows: the shipped tile in row order and in groups of GROUP_M row tiles, a few
    wide tiles, and cuBLAS, whose bits are compared with the kernel's too."""
    print("\nM N K | cuBLAS us (same bits) | shipped, ungrouped us | shipped, grouped us | fastest grouped us, tile "
          "(same bits)")
    layers = [(n, k) for n, k in LAYERS["0.6b"] + LAYERS["1.7b"] if n < 65536]  # training's LM head is chunked
    for m, (n, k) in itertools.product(rows, layers):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        cfg = matmul.tiles(m, n, k)
        ref = launch(x, w, torch.empty(m, n, device="cuda", dtype=x.dtype), *cfg)
        cublas_same = bool(torch.equal(torch.nn.functional.linear(x, w), ref))
        cublas = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=20) * 1e3
        y = torch.empty_like(ref)
        flat = do_bench_cudagraph(lambda: launch(x, w, y, *cfg, group_m=1), rep=20) * 1e3
        flat_same = bool(torch.equal(y, ref))
        grouped = do_bench_cudagraph(lambda: launch(x, w, y, *cfg), rep=20) * 1e3
        found = []
        for tile in TRAINING_TILES:
            try:
                launch(x, w, y, *tile)
                torch.cuda.synchronize()
                found.append((do_bench_cudagraph(lambda: launch(x, w, y, *tile), rep=20) * 1e3, tile,
                              bool(torch.equal(y, ref))))
            except Exception as e:  # out of shared memory or registers for this tile
                print(f"  {tile}: {type(e).__name__}", flush=True)
        us, tile, same = min(found)
        print(f"{m} {n} {k} | {cublas:.1f} ({cublas_same}) | {flat:.1f} ({flat_same}) | {grouped:.1f} | "
              f"{us:.1f} {tile} ({same}, all same: {all(f[2] for f in found)})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--rows", default="64,512,16384")
    p.add_argument("--seconds", type=float, default=300, help="stop starting new shapes after this long")
    p.add_argument("--training", default="", help="comma-separated training row counts: time those instead")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.training:
        return training_rows(list(map(int, args.training.split(","))))
    grid = list(itertools.product((64, 128), (16, 32, 64, 128, 256), (64, 128), (4, 8), (3, 4)))
    if args.quick:
        grid = [c for c in grid if c[2] == 64 and c[4] == 3]
    best, start = {}, time.time()
    for m, (n, k) in itertools.product(map(int, args.rows.split(",")), LAYERS["0.6b"] + LAYERS["1.7b"]):
        if time.time() - start > args.seconds:
            break
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = launch(x, w, torch.empty(m, n, device="cuda", dtype=x.dtype), BLOCK_M, block_n(n), BLOCK_K, 4, 3)
        cublas = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=10) * 1e3
        shipped = do_bench_cudagraph(lambda: launch(x, w, ref, BLOCK_M, block_n(n), BLOCK_K, 4, 3), rep=10) * 1e3
        rows = []
        for bm, bn, bk, warps, stages in grid:
            y = torch.empty_like(ref)
            try:
                launch(x, w, y, bm, bn, bk, warps, stages)
                torch.cuda.synchronize()
                us = do_bench_cudagraph(lambda: launch(x, w, y, bm, bn, bk, warps, stages), rep=10) * 1e3
            except Exception as e:  # out of shared memory or registers for this tile
                rows.append({"cfg": [bm, bn, bk, warps, stages], "error": type(e).__name__})
                continue
            same = bool(torch.equal(y, ref))
            rows.append({"cfg": [bm, bn, bk, warps, stages], "us": round(us, 2), "same_bits": same})
        ok = [r for r in rows if "us" in r]
        same = [r for r in ok if r["same_bits"]]
        fastest = min(same, key=lambda r: r["us"]) if same else None
        differ = sorted({tuple(r["cfg"]) for r in ok if not r["same_bits"]})
        best[(m, n, k)] = (round(cublas, 2), round(shipped, 2), fastest)
        print(json.dumps({"M": m, "N": n, "K": k, "cublas_us": round(cublas, 2), "shipped_us": round(shipped, 2),
                          "best_same_bits": fastest, "configs": len(ok), "configs_other_bits": differ[:12],
                          "n_other_bits": len(differ), "all": [[*r["cfg"], r["us"]] for r in ok]}), flush=True)
    print("\nM N K | cuBLAS us | shipped us | fastest with the same bits: us, (BM BN BK warps stages)")
    for (m, n, k), (cublas, shipped, r) in best.items():
        print(f"{m} {n} {k} | {cublas} | {shipped} | {r and r['us']} {r and r['cfg']}")


if __name__ == "__main__":
    main()
