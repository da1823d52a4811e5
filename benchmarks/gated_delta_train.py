"""The delta rule's training pass at the Qwen3.5-2B shape (16 key and value heads, 128 wide, bf16 activations):
`gated_delta_rule` forward and backward over N sequences of T tokens, as one linear-attention layer of the 8 x 8 x
512 GRPO step runs it (N = 64, T = 640: prompt and completion), by the path training takes (`gated_delta_rule`: on
Hopper under the Triton that torch ships, fla's backward where its probe found it right, `fla_backward_probed`), and
then by fla's forward and the PyTorch chunked form's backward (the path where the probe did not). Prints ms a pass
and peak memory of each, and the largest difference of their gradients; with SAVE=FILE it saves the first path's
gradients, with CHECK=FILE it prints their largest difference from those saved (two trees on the same inputs).
Then the short convolution before it (6,144 channels), forward and backward, by our Triton kernels and by torch's.
    python3 benchmarks/gated_delta_train.py [N T]"""
import os
import sys

import torch

from rlcu.kernels.causal_conv import causal_conv_triton
from rlcu.kernels.gated_delta import (
    _FlaChunked,
    causal_conv_reference,
    fla_backward_probed,
    fla_backward_sound,
    gated_delta_rule,
)

HK, HV, D, CONV = 16, 16, 128, 6144  # CONV: the convolution's channels (q, k and v)


def main():
    n, t = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (64, 640)
    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    q, k = (torch.randn(n * t, HK, D, device=dev, dtype=bf).requires_grad_() for _ in range(2))
    v = torch.randn(n * t, HV, D, device=dev, dtype=bf).requires_grad_()
    g = (-torch.rand(n * t, HV, device=dev) * 0.3).requires_grad_()
    beta = torch.rand(n * t, HV, device=dev, dtype=bf).requires_grad_()
    cu = torch.arange(0, n * t + 1, t, device=dev, dtype=torch.int32)
    do = torch.randn(n * t, HV, D, device=dev, dtype=bf)
    leaves = (q, k, v, g, beta)
    sound = fla_backward_sound(dev)
    probed = sound or fla_backward_probed(dev, HK, HV, D, D, bf)
    print(f"fla's backward here: {'sound' if sound else 'probed right' if probed else 'probed wrong'}")
    paths = {"training's": lambda: gated_delta_rule(q, k, v, g, beta, cu),
             "torch backward": lambda: _FlaChunked.apply(q, k, v, g, beta, cu, None, False)}
    grads = {}
    for name, rule in paths.items():
        ms, peak, grads[name] = _time(rule, leaves, do)
        print(f"{name} N={n} T={t}: {ms:.1f} ms a pass (forward and backward), peak {peak:.2f} GB")
    first, second = grads.values()
    print(f"the two paths' gradients within {_diff(first, second):.2e} (relative)")
    conv_x = torch.randn(n * t, CONV, device=dev, dtype=bf).requires_grad_()
    conv_w = (torch.randn(CONV, 4, device=dev) * 0.3).requires_grad_()
    conv_dy = torch.randn(n * t, CONV, device=dev, dtype=bf)
    convs = {"convolution, Triton": causal_conv_triton, "convolution, torch": lambda *a: causal_conv_reference(*a)[0]}
    conv_grads = {}
    for name, conv in convs.items():
        ms, peak, conv_grads[name] = _time(lambda: (conv(conv_x, conv_w, cu, None),), (conv_x, conv_w), conv_dy)
        print(f"{name} N={n} T={t} C={CONV}: {ms:.2f} ms a pass (forward and backward), peak {peak:.2f} GB")
    print(f"the two convolutions' gradients within {_diff(*conv_grads.values()):.2e} (relative)")
    if os.environ.get("SAVE"):
        torch.save([x.cpu() for x in first], os.environ["SAVE"])
    if os.environ.get("CHECK"):
        print(f"training's gradients within {_diff(first, torch.load(os.environ['CHECK'])):.2e} of the saved")


def _time(rule, leaves, do, reps=5):
    def step():
        for x in leaves:
            x.grad = None
        rule()[0].backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    grads = [x.grad.float().cpu() for x in leaves]
    return start.elapsed_time(end) / reps, torch.cuda.max_memory_allocated() / 1e9, grads


def _diff(a, b):
    return max(((x - y).abs().max() / (1 + y.abs().max())).item() for x, y in zip(a, b))


if __name__ == "__main__":
    main()
