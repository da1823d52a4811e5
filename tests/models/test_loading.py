"""What the loader reads besides the weights: the end-of-sequence ids that generation_config.json adds to
config.json's (gpt-oss's `<|call|>`, Llama 3's `<|eot_id|>`), which transformers' `generate` stops at too."""
import json

import pytest
import transformers

from rlcu.models import load_model
from tests.helpers import tiny_hf_folder


@pytest.mark.parametrize("family", ["qwen3", "gpt_neox"])  # native, and the transformers fallback
def test_generation_configs_stop_ids_join_the_configs(tmp_path, family):
    folder = tiny_hf_folder(tmp_path, family)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [63, 61, 60]}))
    model, _ = load_model(folder)
    assert model.config.eos_token_ids == [63, 61, 60]
    assert transformers.GenerationConfig.from_pretrained(folder).eos_token_id == [63, 61, 60]  # what generate reads
    (folder / "generation_config.json").unlink()
    assert load_model(folder)[0].config.eos_token_ids == [63]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_low_cpu_mem_usage_reads_the_weights_when_asked(tmp_path, family):
    """`low_cpu_mem_usage`: the model comes without memory and reads the checkpoint at `load_pending`, into the same
    tensors an eager load gives (the LM head tied again, a head widened by cast_lm_head_to_fp32 kept wide)."""
    import torch

    from rlcu.models.loading import load_pending

    folder = tiny_hf_folder(tmp_path, family)
    eager, _ = load_model(folder, dtype="bfloat16")
    lazy, tok = load_model(folder, dtype="bfloat16", low_cpu_mem_usage=True)
    assert tok is not None and all(p.device.type == "meta" for p in lazy.parameters())
    if not lazy.config.tie_word_embeddings:  # (tied to bf16 embeddings it is refused, as for an eager load)
        lazy.cast_lm_head_to_fp32()
    assert load_pending(lazy, "cpu") and not hasattr(lazy, "pending_weights")
    want, got = eager.state_dict(), lazy.state_dict()
    assert want.keys() == got.keys() and {v.dtype for v in want.values()} == {torch.bfloat16}
    for k, v in want.items():
        if k == "lm_head.weight" and not eager.config.tie_word_embeddings:
            assert got[k].dtype == torch.float32 and torch.equal(got[k].bfloat16(), v)
        else:
            assert torch.equal(got[k], v), k
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == eager.config.tie_word_embeddings
    assert not load_pending(eager, "cpu")  # nothing pending: nothing read


def test_low_cpu_mem_usage_in_a_grpo_run_and_its_refusals(tmp_path):
    """A GRPO module built with low_cpu_mem_usage holds no weights until Lightning's configure_model, then trains as
    one loaded at once (its reference model for the KL term too); LoRA adapters, which are made on the loaded
    weights, are refused in one line."""
    import torch

    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, match_target, toy_rows

    folder = tiny_hf_folder(tmp_path / "m", "llama")
    runs = {}
    for lazy in (False, True):
        torch.manual_seed(0)
        module = GRPOModule(str(folder), rewards=[match_target], num_generations=2, max_completion_length=3,
                            learning_rate=1e-2, eval_at_start=False, low_cpu_mem_usage=lazy, beta=0.04)
        assert (module.policy.device.type == "meta") == (module.ref_model.device.type == "meta") == lazy
        fit(module, toy_rows(4), 1, tmp_path / f"logs-{lazy}", batch_size=2)
        runs[lazy] = {k: v.clone() for k, v in module.policy.state_dict().items()}
    assert all(torch.equal(runs[True][k], v) for k, v in runs[False].items())
    with pytest.raises(ValueError, match="peft_config with low_cpu_mem_usage"):
        GRPOModule(str(folder), rewards=[match_target], low_cpu_mem_usage=True, peft_config={"r": 2})


def gpu_of(monkeypatch, gigabytes: float):
    """torch.cuda's answer for a GPU of this size, on a machine without one (the check runs before any memory is
    taken)."""
    import types

    import torch

    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=int(gigabytes * 1e9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_weights_that_no_one_gpu_holds_are_refused_in_one_line(tmp_path, monkeypatch):
    """`require_fits` counts what a model moved whole to one GPU holds (on the meta device too, before its weights
    are read) and refuses, naming the sizes and the fix, weights larger than the GPU; other devices are never
    checked."""
    import torch

    from rlcu.models.loading import require_fits, weight_bytes

    folder = tiny_hf_folder(tmp_path, "qwen3")
    model, _ = load_model(folder)
    lazy, _ = load_model(folder, low_cpu_mem_usage=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert lazy.device.type == "meta" and weight_bytes(lazy) == weight_bytes(model)
    assert weight_bytes(model) >= 4 * hf.num_parameters()  # fp32 parameters, and rlcu's buffers beside them
    gpu_of(monkeypatch, 150.0)
    require_fits(149_999_000_000, "cuda", "m")
    with pytest.raises(ValueError, match=r"^m: 150\.1 GB of weights do not fit one NVIDIA H200 \(150\.0 GB\): "
                                         r"shard them across GPUs \(--trainer\.strategy=fsdp2"):
        require_fits(150_100_000_000, torch.device("cuda", 0), "m")
    require_fits(10**15, "cpu", "m")


def test_a_grpo_module_refuses_a_policy_too_large_for_its_gpu_at_set_up(tmp_path, monkeypatch):
    """Before Lightning moves the policy and its reference model whole to the GPU (one device, or DDP); sharded
    strategies (fsdp2, tp) are never refused here."""
    import types

    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    from rlcu.grpo.module import GRPOModule
    from rlcu.models.loading import weight_bytes
    from tests.helpers import match_target

    module = GRPOModule(str(tiny_hf_folder(tmp_path, "qwen3")), rewards=[match_target], beta=0.04)
    size = weight_bytes(module.policy) + weight_bytes(module.ref_model)
    gpu_of(monkeypatch, size / 1e9 * 0.99)
    cuda = SingleDeviceStrategy(device=torch.device("cuda", 0))
    monkeypatch.setattr(module, "_attached_trainer", lambda: types.SimpleNamespace(strategy=cuda, world_size=1))
    with pytest.raises(ValueError, match="^the policy and its reference model: .* GB of weights do not fit one"):
        module.setup("fit")
    sharded = ModelParallelStrategy()
    monkeypatch.setattr(module, "_attached_trainer", lambda: types.SimpleNamespace(strategy=sharded, world_size=1))
    monkeypatch.setattr("rlcu.grpo.module.bind", lambda *args: None)  # the refusal is what this test is about
    module.setup("fit")
