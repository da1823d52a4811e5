"""A decode step's GEMMs at a model's own shapes, as the engine's CUDA graph replays them: every projection of rlcu's
decoder for MODEL (its LM head included), each with its own weights, so that no projection finds its weights in L2
where a decode step would not. At M rows (a decode step's batch), bf16: cuBLAS (`F.linear`, the default mode's
GEMM) against rlcu's Triton GEMM (rlcu/kernels/matmul.py, exact mode's) over column tiles, K steps and pipeline
stages. Per (N, K): the time a projection and the rate its weights are read at, each way; then the step's GEMMs
in one graph by cuBLAS alone and by the faster of the two for each shape (docs/benchmarks.md).
    python3 benchmarks/decode_gemm.py MODEL [M]        (MODEL: a name `rlcu bench --model` takes)"""
import collections
import itertools
import sys

import torch
from triton.testing import do_bench_cudagraph

from rlcu.bench import build_model
from rlcu.kernels import matmul
from rlcu.models.fused_linear import Linear

TILES = list(itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4, 6)))  # columns, K step, stages; 4 warps


def projections(name: str) -> list[tuple[int, int]]:
    """(N, K) of each projection of the model, in the order a forward runs them (built on the meta device)."""
    model, _ = build_model(name, "meta", "bfloat16")
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)]


def timed(fns) -> float:
    """Seconds for the calls `fns`, one after another in one CUDA graph."""
    def step():
        for fn in fns:
            fn()
    return do_bench_cudagraph(step, rep=30) / 1e3


def main():
    name, m = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
    shapes = projections(name)
    counts = collections.Counter(shapes)
    dev, bf = "cuda", torch.bfloat16
    weights = [torch.randn(n, k, device=dev, dtype=bf) / k ** 0.5 for n, k in shapes]
    xs = {k: torch.randn(m, k, device=dev, dtype=bf) for _, k in shapes}
    ys = [torch.empty(m, n, device=dev, dtype=bf) for n, _ in shapes]
    bm = 16 if m <= 16 else 32 if m <= 32 else 64

    def cublas(i):
        return lambda: torch.mm(xs[shapes[i][1]], weights[i].t(), out=ys[i])

    def triton_(i, bn, bk, stages):
        return lambda: matmul.launch(xs[shapes[i][1]], weights[i], None, ys[i], bm, bn, bk, 4, stages, 1)

    gb = sum(n * k * 2 for n, k in shapes) / 1e9
    print(f"{name}: {len(shapes)} projections, {gb:.2f} GB of bf16 weights, M = {m}", flush=True)
    print("N K (count) | cuBLAS us a projection (TB/s) | best Triton us (TB/s), tile (columns, K step, stages) | "
          "shipped exact tile us")
    best = {}
    for (n, k), count in counts.items():
        idx = [i for i, s in enumerate(shapes) if s == (n, k)]
        want = torch.nn.functional.linear(xs[k], weights[idx[0]]).float()
        base = timed([cublas(i) for i in idx]) / count
        found = []
        for bn, bk, stages in TILES:
            try:
                triton_(idx[0], bn, bk, stages)()
                torch.cuda.synchronize()
            except Exception as error:  # past the GPU's shared memory or registers
                print(f"  tile {(bn, bk, stages)}: {type(error).__name__}", flush=True)
                continue
            err = (ys[idx[0]].float() - want).abs().max().item()
            if err > 0.05:
                raise SystemExit(f"tile {(bn, bk, stages)} at {(n, k)}: |diff| {err:.3g} from cuBLAS")
            found.append((timed([triton_(i, bn, bk, stages) for i in idx]) / count, (bn, bk, stages)))
        found.sort()
        shipped_bm, shipped_bn, shipped_bk, warps, shipped_st = matmul.tiles(m, n, k)
        shipped = timed([lambda i=i: matmul.launch(xs[k], weights[i], None, ys[i], shipped_bm, shipped_bn, shipped_bk,
                                                   warps, shipped_st, 1) for i in idx]) / count
        t, tile = found[0]
        best[(n, k)] = (t, tile) if t < base else None
        rate = n * k * 2 / 1e12
        print(f"{n} {k} ({count}) | {base * 1e6:7.1f} ({rate / base:4.2f}) | {t * 1e6:7.1f} ({rate / t:4.2f}) {tile} | "
              f"{shipped * 1e6:7.1f}", flush=True)
    all_cublas = timed([cublas(i) for i in range(len(shapes))])
    mixed = timed([cublas(i) if best[s] is None else triton_(i, *best[s][1]) for i, s in enumerate(shapes)])
    print(f"a step's GEMMs: cuBLAS {all_cublas * 1e3:.3f} ms ({gb / all_cublas / 1e3:.2f} TB/s); the faster of the "
          f"two a shape {mixed * 1e3:.3f} ms ({gb / mixed / 1e3:.2f} TB/s): {all_cublas / mixed:.3f}x")


if __name__ == "__main__":
    main()
