"""TRL's GRPO step on one of `rlcu bench`'s FAMILY_SHAPES: the same transformers config (rlcu.bench.family_config),
random bf16 weights saved as an HF folder with the peers' word-level tokenizer, then ../shared/peers/trl_grpo.py
run unchanged on that folder (its model builder swapped for this one).

    python3 benchmarks/trl_family.py PEERS_DIR NAME P G L STEPS        (LORA=R as trl_grpo.py)

LORA_EXPERTS=1 adds PEFT's target_parameters for the stacked experts of an MoE model to the peer's LoraConfig,
as `rlcu bench step --lora_experts` adds them on rlcu's side.

TRL_FLA=lifted (a linear-attention hybrid, fla on the path): transformers runs fla's chunked delta rule, and where
fla's guard refuses its backward (Hopper under Triton 3.4 to 3.7.0) the guard is lifted for the whole run if rlcu's
probe finds fla's backward right at the model's shapes (`fla_backward_probed`), as rlcu's training lifts it; if the
probe finds it wrong, the run stops saying so. TRL with fla, as issue #43's targets name it."""
import contextlib
import os
import runpy
import sys

import torch

peers, name = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, peers)
import common  # noqa: E402  (../shared/peers/common.py)

from rlcu.bench import family_config  # noqa: E402


def fla_for_trl(config):
    """The context TRL runs in: fla's guard lifted where rlcu's probe found fla's backward right (TRL_FLA=lifted)."""
    if os.environ.get("TRL_FLA") != "lifted":
        return contextlib.nullcontext()
    from rlcu.kernels.gated_delta import fla_backward_probed, fla_backward_sound, fla_guard_lifted, require_fla

    require_fla()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    if fla_backward_sound(dev):
        print("TRL_FLA fla's backward is sound here: nothing to lift", flush=True)
        return contextlib.nullcontext()
    # rlcu's probe runs fla's variable-length kernels; transformers calls fla on padded rows, its other variant
    if not (fla_backward_probed(dev, *shape, torch.bfloat16) and padded_backward_right(dev, *shape)):
        sys.exit(f"TRL_FLA=lifted: fla's backward probed wrong at heads/widths {shape}: TRL cannot train with fla here")
    print(f"TRL_FLA fla's guard lifted: its backward probed right at heads/widths {shape}", flush=True)
    return fla_guard_lifted()


def padded_backward_right(dev, hk, hv, dk, dv, rows=2, t=128):
    """fla's backward on a padded batch (no cu_seqlens, as transformers calls it), its guard lifted, against autograd
    of rlcu's fp32 recurrence of the same rows."""
    from rlcu.kernels.gated_delta import fla_guard_lifted, fla_ops, gated_delta_reference

    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(rows, t, hk, dk, generator=gen), torch.randn(rows, t, hk, dk, generator=gen),
         torch.randn(rows, t, hv, dv, generator=gen), -torch.rand(rows, t, hv, generator=gen) * 0.3,
         torch.rand(rows, t, hv, generator=gen)]
    do = torch.randn(rows, t, hv, dv, generator=gen)
    got = [a.to(dev, torch.bfloat16 if i != 3 else torch.float32, copy=True).requires_grad_() for i, a in enumerate(x)]
    with fla_guard_lifted():
        o, _ = fla_ops()[0](*got[:3], g=got[3], beta=got[4], use_qk_l2norm_in_kernel=True)
        o.backward(do.to(dev, o.dtype))
    want = [a.to(dev, copy=True).flatten(0, 1).requires_grad_() for a in x]
    cu = torch.arange(0, rows * t + 1, t, device=dev, dtype=torch.int32)
    o, _ = gated_delta_reference(*want, cu)
    o.backward(do.to(dev).flatten(0, 1))
    return all(((a.grad.float().flatten(0, 1) - b.grad).abs().max() <= 0.05 * (1 + b.grad.abs().max())).item()
               for a, b in zip(got, want))


def make_model(_path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    path = f"/tmp/{name}"
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(family_config(name), dtype=dtype)
        model.save_pretrained(path)
        common.make_tokenizer(model.config.vocab_size, path)
    return path


if os.environ.get("LORA_EXPERTS"):
    import peft

    from rlcu.bench import EXPERT_PARAMETERS

    class ExpertLoraConfig(peft.LoraConfig):  # the peer builds LoraConfig(...) itself: experts join its targets
        def __init__(self, *args, **kwargs):
            super().__init__(*args, target_parameters=EXPERT_PARAMETERS, **kwargs)

    peft.LoraConfig = ExpertLoraConfig

common.make_model = make_model
common.QWEN3_06B["vocab_size"] = family_config(name).vocab_size  # the prompts' token range
print("TRL model", name, flush=True)
sys.argv = ["trl_grpo.py", *sys.argv[3:]]
os.chdir(peers)
with fla_for_trl(family_config(name)):
    runpy.run_path(os.path.join(peers, "trl_grpo.py"), run_name="__main__")
