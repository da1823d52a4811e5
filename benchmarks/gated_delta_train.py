"""The delta rule's training pass at the Qwen3.5-2B shape (16 key and value heads, 128 wide, bf16 activations):
`gated_delta_rule` forward and backward over N sequences of T tokens, as one linear-attention layer of the 8 x 8 x
512 GRPO step runs it (N = 64, T = 640: prompt and completion). On Hopper under the Triton that torch ships, fla's
forward and the PyTorch chunked form's backward (`fla_backward_sound`). Prints ms a pass and peak memory; with
SAVE=FILE it saves the gradients, with CHECK=FILE it prints the largest difference from those saved (two trees
compared on the same inputs).
    python3 benchmarks/gated_delta_train.py [N T]"""
import os
import sys

import torch

from rlcu.kernels.gated_delta import gated_delta_rule

HK, HV, D = 16, 16, 128


def main():
    n, t = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (64, 640)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q, k = (torch.randn(n * t, HK, D, device=dev, dtype=bf).requires_grad_() for _ in range(2))
    v = torch.randn(n * t, HV, D, device=dev, dtype=bf).requires_grad_()
    g = (-torch.rand(n * t, HV, device=dev) * 0.3).requires_grad_()
    beta = torch.rand(n * t, HV, device=dev, dtype=bf).requires_grad_()
    cu = torch.arange(0, n * t + 1, t, device=dev, dtype=torch.int32)
    do = torch.randn(n * t, HV, D, device=dev, dtype=bf)
    leaves = (q, k, v, g, beta)

    def step():
        for x in leaves:
            x.grad = None
        o, _ = gated_delta_rule(q, k, v, g, beta, cu)
        o.backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    grads = [x.grad.float() for x in leaves]
    peak = torch.cuda.max_memory_allocated() / 1e9
    line = f"train N={n} T={t}: {start.elapsed_time(end) / reps:.1f} ms a pass, peak {peak:.2f} GB"
    if os.environ.get("SAVE"):
        torch.save([x.cpu() for x in grads], os.environ["SAVE"])
    if os.environ.get("CHECK"):
        saved = torch.load(os.environ["CHECK"])
        diff = max(((a.cpu() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(grads, saved))
        line += f", gradients within {diff:.2e} (relative) of the saved"
    print(line)


if __name__ == "__main__":
    main()
