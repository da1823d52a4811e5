"""Experts' GEMMs at decode and training sizes: rlcu's batch-invariant grouped kernel (exact mode's, one launch for
every expert) over a few tiles, against torch's grouped GEMM (the default mode's), on one GPU.

Each launch is timed inside a CUDA graph (launch cost out, as in the engine's decode), with tokens routed to
experts at random (top-k of uniform logits), and every tile's output is compared with the shipped tile's bits.
Whether the default mode's decode should take the kernel too is the question it answers (docs/benchmarks.md,
"1649c44").

    python3 benchmarks/grouped_gemm.py [--tokens 64,512,4096]
    TRITON_INTERPRET=1 python3 benchmarks/grouped_gemm.py --check   # the script on the CPU, a tiny shape
"""
import argparse

import torch

from rlcu.kernels.matmul import grouped_linear_triton, grouped_tile

SHAPES = {  # (experts, top_k, [(N, K)] of gate_up and down)
    "qwen3-30b-a3b": (128, 8, [(1536, 2048), (2048, 768)]),
    "gpt-oss-20b": (32, 4, [(5760, 2880), (2880, 2880)]),
}
TILES = [(64, 64, 64, 4, 3), (32, 64, 64, 4, 3), (16, 64, 128, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
         (16, 64, 128, 4, 6), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 128, 2, 6),
         (32, 128, 64, 4, 4), (32, 128, 128, 4, 3), (64, 128, 128, 8, 3), (32, 256, 64, 8, 3), (64, 256, 64, 8, 3)]


def routed(tokens: int, experts: int, top_k: int, k: int, device, dtype):
    """(rows [tokens * top_k, k] sorted by expert, counts [experts]) of tokens routed at random."""
    g = torch.Generator(device="cpu").manual_seed(tokens)
    chosen = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts).to(device)
    rows = torch.randn(tokens * top_k, k, generator=g).to(device, dtype)
    return rows, counts


def check() -> None:
    torch.manual_seed(0)
    x, counts = routed(9, 4, 2, 40, "cpu", torch.float32)
    w = torch.randn(4, 24, 40) / 40 ** 0.5
    shipped = grouped_linear_triton(x, w, counts)
    # tiles of the shipped K width only: the interpreter's tl.dot sums a K block in one matmul, unlike the tensor
    # cores' steps of 16 (the tests emulate those: tests/conftest.py, fixed_order_dot)
    for tile in [t for t in TILES if t[2] == 64]:
        print(tile, "same bits" if torch.equal(grouped_linear_triton(x, w, counts, tile), shipped) else "DIFFERENT")


def main() -> None:
    from triton.testing import do_bench_cudagraph

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="64,512,4096")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        return check()
    dtype = torch.bfloat16
    print("shape tokens N K | torch grouped us (GB/s of weights) | shipped tile us | tiles us (same bits)")
    for name, (experts, top_k, layers) in SHAPES.items():
        for tokens in map(int, args.tokens.split(",")):
            for n, k in layers:
                x, counts = routed(tokens, experts, top_k, k, "cuda", dtype)
                w = torch.randn(experts, n, k, device="cuda", dtype=dtype) / k ** 0.5
                ends = counts.cumsum(0).to(torch.int32)
                used = int((counts > 0).sum()) * n * k * 2  # the weights of the experts with rows: bytes read
                vendor = do_bench_cudagraph(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)) * 1e3
                shipped = grouped_linear_triton(x, w, counts)
                ship_us = do_bench_cudagraph(lambda: grouped_linear_triton(x, w, counts)) * 1e3
                cells = []
                for tile in TILES:
                    us = do_bench_cudagraph(lambda t=tile: grouped_linear_triton(x, w, counts, t)) * 1e3
                    same = torch.equal(grouped_linear_triton(x, w, counts, tile), shipped)
                    cells.append(f"{tile} {us:.1f}{'' if same else ' DIFFERENT'}")
                print(f"{name} {tokens} {n} {k} | {vendor:.1f} ({used / vendor / 1e3:.0f}) | {ship_us:.1f} "
                      f"{grouped_tile(len(x), experts)[:3]} | " + "; ".join(cells))


if __name__ == "__main__":
    main()
