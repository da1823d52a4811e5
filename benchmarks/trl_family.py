"""TRL's GRPO step on one of `rlcu bench`'s FAMILY_SHAPES: the same transformers config (rlcu.bench.family_config),
random bf16 weights saved as an HF folder with the peers' word-level tokenizer, then ../shared/peers/trl_grpo.py
run unchanged on that folder (its model builder swapped for this one).

    python3 benchmarks/trl_family.py PEERS_DIR NAME P G L STEPS        (LORA=R as trl_grpo.py)

LORA_EXPERTS=1 adds PEFT's target_parameters for the stacked experts of an MoE model to the peer's LoraConfig,
as `rlcu bench step --lora_experts` adds them on rlcu's side."""
import os
import runpy
import sys

import torch

peers, name = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, peers)
import common  # noqa: E402  (../shared/peers/common.py)

from rlcu.bench import family_config  # noqa: E402


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
runpy.run_path(os.path.join(peers, "trl_grpo.py"), run_name="__main__")
