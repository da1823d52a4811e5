"""The offloaded optimizer's host step (`MasterWeightAdamW(offload=True)`) per parameter, on this machine's
CPU, with fp32 and bf16 moments: a bf16 parameter of N elements, its gradient, one warm-up step, then the
mean of REPEATS steps. On a machine without a GPU the transfers are plain host copies.

    python benchmarks/offload_step.py [N] [REPEATS]"""
import json
import sys
import time

import torch

from rlcu.grpo.optim import MasterWeightAdamW


def main(n: int = 20_000_000, repeats: int = 3) -> dict:
    result = {"parameters": n, "threads": torch.get_num_threads(), "torch": torch.__version__}
    for state_dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
        opt = MasterWeightAdamW([param], lr=1e-3, state_dtype=state_dtype, offload=True)
        param.grad = torch.randn(n).to(torch.bfloat16)
        opt.step(grad_scale=0.5)
        start = time.perf_counter()
        for _ in range(repeats):
            opt.step(grad_scale=0.5)
        seconds = (time.perf_counter() - start) / repeats
        result[f"ns_per_parameter_{str(state_dtype).split('.')[-1]}_moments"] = round(seconds * 1e9 / n, 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
