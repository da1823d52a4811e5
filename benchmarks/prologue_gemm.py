"""Whether a decode step's small kernels can go into the next GEMM's prologue at a few rows: RMSNorm (with the
residual add) before the qkv and gate_up projections, SiLU x up before the down projection, at M rows of the
Qwen3-0.6B shape, bf16. Each side runs the 28 layers' worth of distinct weights inside one CUDA graph (as the
engine replays a step, so no projection finds its weights in L2): rlcu's RMSNorm / SiLU kernels then cuBLAS,
against one Triton kernel that computes the prologue on each tile of rows as it loads it, over tiles of 16-64
columns, K steps of 64-256 and 3-4 stages. The kernels are kept here, not in rlcu/: this asks whether the fusion
pays before the engine takes it (docs/benchmarks.md).
    python3 benchmarks/prologue_gemm.py [M]
Without CUDA it checks the two kernels against PyTorch under the Triton interpreter (fp16) and times nothing."""
import itertools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rlcu.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from rlcu.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, LAYERS, EPS = 1024, 3072, 4096, 28, 1e-6


@triton.jit
def _rms_linear(X, R, G, W, Y, H, M, N, K, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y = rmsnorm(X + R) * G @ W.T, and H = X + R (the residual stream, written by the first column tile). The
    norm's 1/rms is a factor of each row, so it is applied to the accumulator after the K loop: one pass."""
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        inside = (rows[:, None] < M) & (kk[None, :] < K)
        h = tl.load(X + rows[:, None] * K + kk[None, :], mask=inside, other=0.0).to(tl.float32)
        h += tl.load(R + rows[:, None] * K + kk[None, :], mask=inside, other=0.0).to(tl.float32)
        if pid_n == 0:
            tl.store(H + rows[:, None] * K + kk[None, :], h.to(H.dtype.element_ty), mask=inside)
        sumsq += tl.sum(h * h, 1)
        g = tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32)
        a = (h * g[None, :]).to(W.dtype.element_ty)
        w = tl.load(W + cols[:, None] * K + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
    tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _silu_linear(GU, W, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y = (silu(gate) * up) @ W.T with GU = [gate | up], [M, 2K]; the product is rounded to W's dtype, as the
    separate kernel stores it."""
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        inside = (rows[:, None] < M) & (kk[None, :] < K)
        gate = tl.load(GU + rows[:, None] * 2 * K + kk[None, :], mask=inside, other=0.0).to(tl.float32)
        up = tl.load(GU + rows[:, None] * 2 * K + K + kk[None, :], mask=inside, other=0.0).to(tl.float32)
        a = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)
        w = tl.load(W + cols[:, None] * K + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def rms_linear(x, residual, g, w, launch=(64, 64, 3)):
    bn, bk, stages = launch
    m, k = x.shape
    assert m <= 64, "one tile of 64 rows: a decode step's few"
    y = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    _rms_linear[(triton.cdiv(w.shape[0], bn),)](x, residual, g, w, y, h, m, w.shape[0], k, EPS, BLOCK_M=64,
                                                BLOCK_N=bn, BLOCK_K=bk, num_stages=stages, num_warps=4)
    return y, h


def silu_linear(gu, w, launch=(64, 64, 3)):
    bn, bk, stages = launch
    m, k = gu.shape[0], gu.shape[1] // 2
    assert m <= 64, "one tile of 64 rows: a decode step's few"
    y = torch.empty(m, w.shape[0], dtype=gu.dtype, device=gu.device)
    _silu_linear[(triton.cdiv(w.shape[0], bn),)](gu, w, y, m, w.shape[0], k, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk,
                                                 num_stages=stages, num_warps=4)
    return y


def rms_reference(x, residual, g, w):
    normed, h = rms_norm_reference(x, g, EPS, residual)
    return torch.nn.functional.linear(normed, w), h


def silu_reference(gu, w):
    return torch.nn.functional.linear(silu_mul_reference(gu), w)


def check(m, dtype, device):
    """Both kernels against PyTorch on odd sizes (m rows, K not a multiple of the K step)."""
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(m, 200, generator=gen).to(dtype).to(device) for _ in range(2))
    g = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype).to(device)
    w = (torch.randn(80, 200, generator=gen) / 200 ** 0.5).to(dtype).to(device)
    (y, h), (y_ref, h_ref) = rms_linear(x, res, g, w, (32, 64, 2)), rms_reference(x, res, g, w)
    assert torch.equal(h, h_ref), "the residual stream differs"
    print(f"rms_linear  m={m} {dtype}: max |diff| {(y.float() - y_ref.float()).abs().max().item():.1e}")
    gu = torch.randn(m, 400, generator=gen).to(dtype).to(device)
    y, y_ref = silu_linear(gu, w, (32, 64, 2)), silu_reference(gu, w)
    print(f"silu_linear m={m} {dtype}: max |diff| {(y.float() - y_ref.float()).abs().max().item():.1e}")


def graph_us(fn, calls: int) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=50) * 1e3 / calls


def main(m: int):
    check(m, torch.bfloat16, "cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(m, HIDDEN, **bf), torch.randn(m, HIDDEN, **bf)
    g = torch.ones(HIDDEN, **bf)
    gu = torch.randn(m, 2 * INTERMEDIATE, **bf)
    shapes = {"rmsnorm + qkv": (QKV, HIDDEN), "rmsnorm + gate_up": (2 * INTERMEDIATE, HIDDEN),
              "silu + down": (HIDDEN, INTERMEDIATE)}
    total_split = total_fused = 0.0
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, **bf) / k ** 0.5 for _ in range(LAYERS)]
        if name.startswith("silu"):
            split = lambda: [torch.nn.functional.linear(silu_mul(gu), w) for w in ws]  # noqa: E731, B023
            fused = lambda launch: [silu_linear(gu, w, launch) for w in ws]  # noqa: E731, B023
        else:
            split = lambda: [torch.nn.functional.linear(rms_norm(x, g, EPS, res)[0], w) for w in ws]  # noqa: E731, B023
            fused = lambda launch: [rms_linear(x, res, g, w, launch) for w in ws]  # noqa: E731, B023
        base = graph_us(split, LAYERS)
        timed = []
        for launch in itertools.product((16, 32, 64), (64, 128, 256), (3, 4)):
            try:
                timed.append((graph_us(lambda: fused(launch), LAYERS), launch))  # noqa: B023
            except Exception as error:  # a launch past the shared memory or registers of the GPU
                print(f"  {name} {launch} failed: {type(error).__name__}")
        timed.sort()
        mb = n * k * 2 / 1e6
        print(f"M={m} {name}: kernel + cuBLAS {base:6.2f} us ({mb / base:4.2f} TB/s of weights); fused, best "
              + ", ".join(f"{t:6.2f} us {launch}" for t, launch in timed[:3]), flush=True)
        total_split += base
        total_fused += timed[0][0]
    print(f"M={m} a layer's three: kernel + cuBLAS {total_split:.1f} us, fused (best launch each) {total_fused:.1f} us")


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    if torch.cuda.is_available():
        main(rows)
    else:
        for rows_ in (rows, 5):
            check(rows_, torch.float16, "cpu")
