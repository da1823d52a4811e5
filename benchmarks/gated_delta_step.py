"""A hybrid decode step's per-layer kernels at the Qwen3.5-2B shape (16 value heads, key and value heads 128 wide,
bf16 activations, fp32 states in a pool of 2N slots, shuffled): the delta rule's in-place step over the tiles it
may take (value columns a program, warps), the convolution's window step, and the gated output norm as one kernel
against `rms_norm_reference`'s PyTorch passes (the layer's own before 0de35c4). Each timed inside a CUDA graph, as
the engine replays them; the delta rule's bytes are its states' read and write, the rate they are moved at printed
beside (docs/benchmarks.md).
    python3 benchmarks/gated_delta_step.py [N ...]       (sequences, default 64 512)"""
import sys

import torch
from triton.testing import do_bench_cudagraph

from rlcu.kernels.gated_delta import _delta_triton, causal_conv_step_
from rlcu.kernels.rmsnorm import rms_norm, rms_norm_reference

HV, DK, DV, CONV, K = 16, 128, 128, 6144, 4


def main():
    for n in [int(a) for a in sys.argv[1:]] or [64, 512]:
        torch.manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        q, k = (torch.randn(n, HV, DK, device=dev, dtype=bf) for _ in range(2))
        v = torch.randn(n, HV, DV, device=dev, dtype=bf)
        a, b = (torch.randn(n, HV, device=dev, dtype=bf) for _ in range(2))
        A_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV, device=dev)
        pool = torch.randn(2 * n, HV, DK, DV, device=dev) * 0.01
        slots = torch.randperm(2 * n, device=dev)[:n]
        state_gb = 2 * n * HV * DK * DV * 4 / 1e9
        want = None  # the shipped tile's output, first
        tiles = [(32, 4)] + [(bv, w) for bv in (16, 32, 64, 128) for w in (2, 4, 8) if (bv, w) != (32, 4)]
        for block_v, warps in tiles:
            fn = lambda: _delta_triton(q, k, v, a, b, A_log, dt_bias, pool, slots,  # noqa: E731
                                       block_v=block_v, num_warps=warps)
            saved = pool.clone()
            out = fn()
            torch.cuda.synchronize()
            pool.copy_(saved)
            want = out if want is None else want
            us = do_bench_cudagraph(fn, rep=50) * 1e3
            pool.copy_(saved)
            err = (out.float() - want.float()).abs().max().item()
            print(f"delta N={n} BLOCK_V={block_v} warps={warps}: {us:8.1f} us  {state_gb / us * 1e6:7.0f} GB/s  "
                  f"max|o - shipped tile| {err:.1e}", flush=True)
        x = torch.randn(n, CONV, device=dev, dtype=bf)
        w = torch.randn(CONV, K, device=dev, dtype=bf)
        windows = torch.randn(2 * n, CONV, K - 1, device=dev, dtype=bf)
        us = do_bench_cudagraph(lambda: causal_conv_step_(x, w, windows, slots), rep=50) * 1e3
        print(f"conv N={n}: {us:8.1f} us", flush=True)
        o = torch.randn(n, HV, DV, device=dev, dtype=bf)
        z = torch.randn(n, 2 * HV * DV, device=dev, dtype=bf)[:, :HV * DV].unflatten(-1, (HV, DV))
        nw = torch.ones(DV, device=dev)  # fp32: the weights under bf16-mixed
        with torch.no_grad():
            fused = do_bench_cudagraph(lambda: rms_norm(o, nw, 1e-6, gate=z), rep=50) * 1e3
            passes = do_bench_cudagraph(lambda: rms_norm_reference(o, nw, 1e-6, gate=z), rep=50) * 1e3
            want = rms_norm_reference(o, nw, 1e-6, gate=z)
            err = (rms_norm(o, nw, 1e-6, gate=z).float() - want.float()).abs().max().item()
        print(f"gated norm N={n}: kernel {fused:7.1f} us, PyTorch passes {passes:7.1f} us, max|diff| {err:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
