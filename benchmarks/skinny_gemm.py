"""Whether a Triton GEMM beats cuBLAS at a decode step's few rows: the four projections of a Qwen3-0.6B layer
(qkv, gate_up, o, down) at M rows, bf16, each timed inside a CUDA graph as the engine replays them, against a
Triton kernel over tiles of 16-128 columns, K steps of 64-256, 1-8 splits of K (partials summed after) and
3-5 pipeline stages. Prints cuBLAS and the fastest four Triton launches of each shape (docs/benchmarks.md).
The kernel is rlcu/kernels/matmul.py's loop with split K added, kept here: the project's own must never split K
(its rows are batch-invariant for exact_logprobs), and the sweep found nothing to take from this one.
    python3 benchmarks/skinny_gemm.py [M]"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def _skinny(X, W, P, Y, M, N, K, stride_xm, stride_wn, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + ks
        x = tl.load(X + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT == 1:
        tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=inside)
    else:
        tl.store(P + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=inside)


def skinny(x, w, bn, bk, split, stages, warps):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    p = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    kps = triton.cdiv(triton.cdiv(k, split), bk) * bk
    _skinny[(triton.cdiv(n, bn), split)](x, w, p, y, m, n, k, x.stride(0), w.stride(0), kps, BLOCK_M=64, BLOCK_N=bn,
                                         BLOCK_K=bk, SPLIT=split, num_stages=stages, num_warps=warps)
    return p.sum(0, dtype=torch.float32).to(x.dtype) if split > 1 else y


def main():
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    total_cublas = total_best = 0.0
    for n, k in [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        want = torch.nn.functional.linear(x, w)
        ref = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=30)
        gb = n * k * 2 / 1e9
        res = []
        grid = itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8), (3, 4, 5), (4,))
        for bn, bk, split, stages, warps in grid:
            if k // split < bk:
                continue
            try:
                got = skinny(x, w, bn, bk, split, stages, warps)
                err = (got.float() - want.float()).abs().max().item()
                t = do_bench_cudagraph(lambda: skinny(x, w, bn, bk, split, stages, warps), rep=20)  # noqa: B023
                res.append((t, err, (bn, bk, split, stages, warps)))
            except Exception as error:  # a launch past the shared memory or registers of the GPU
                print("fail", (bn, bk, split, stages), type(error).__name__)
        res.sort()
        print(f"M={m} N={n} K={k}: cuBLAS {ref * 1e3:6.1f} us ({gb / ref * 1e3:5.0f} GB/s)", flush=True)
        for t, err, cfg in res[:4]:
            print(f"   triton {t * 1e3:6.1f} us ({gb / t * 1e3:5.0f} GB/s) |diff| {err:.1e} "
                  f"bn,bk,split,stages,warps={cfg}", flush=True)
        total_cublas += ref
        total_best += res[0][0]
    print(f"M={m} layer total: cuBLAS {total_cublas * 1e3:.1f} us, best triton {total_best * 1e3:.1f} us")


if __name__ == "__main__":
    main()
