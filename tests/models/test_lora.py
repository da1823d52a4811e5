"""LoRA in rlcu's models: base + adapter equals the merged model (training forward and the engine), the
adapters save in PEFT's format and PEFT loads them onto the transformers model with the same logits, a
GRPO step changes the adapters only, and the engine's next rollout runs the stepped adapters in place."""
import copy

import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.module import GRPOModule
from rlcu.models import LoraSpec, add_lora, load_model, merge_lora, save_adapter
from rlcu.models.lora import adapters, lora_disabled
from rlcu.rollout import SamplingParams
from tests.helpers import CHAT_TEMPLATE, PROMPTS, fit, match_target, tiny_hf_folder, toy_rows

ATOL = 1e-5


def with_adapters(folder, targets="all-linear", seed=0):
    """The tiny model with LoRA adapters whose B is random (a fresh B is zero, which would test nothing)."""
    model, tok = load_model(folder)
    add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": targets})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.copy_(0.1 * torch.randn(m.lora.lora_B.shape, generator=g))
    return model.eval(), tok


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["k_proj", "down_proj"]])
@pytest.mark.parametrize("grad", [True, False])  # the training forward's block-diagonal B; the engine's per-part GEMMs
def test_adapters_equal_the_merged_model(tmp_path, family, targets, grad):
    model, _ = with_adapters(tiny_hf_folder(tmp_path, family), targets)
    merged = copy.deepcopy(model)
    merge_lora(merged)
    assert not adapters(merged)
    ids = torch.randint(0, 60, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.set_grad_enabled(grad):
        assert (model.logits(ids, mask) - merged.logits(ids, mask)).abs().max() < ATOL
    with lora_disabled(model):  # and off, the base model
        base, _ = load_model(tiny_hf_folder(tmp_path / "base", family))
        assert (model.logits(ids) - base.logits(ids)).abs().max() < ATOL


def test_fp32_adapters_under_bf16_autocast_agree_with_and_without_gradients(tmp_path):
    """Without gradients the parts' updates are in-place GEMMs, which autocast does not cast: fp32 B into bf16 y."""
    model, _ = with_adapters(tiny_hf_folder(tmp_path, "qwen3"))
    ids = torch.randint(0, 60, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            inference = model.logits(ids)
        training = model.logits(ids)
    assert inference.dtype == training.dtype
    assert (inference.float() - training.float()).abs().max() < 0.05  # bf16 rounding of the two orders


def test_the_engine_runs_base_plus_adapter(tmp_path):
    model, _ = with_adapters(tiny_hf_folder(tmp_path, "qwen3"))
    merged = copy.deepcopy(model)
    merge_lora(merged)
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    got = LLMEngine(model, EngineConfig(max_num_batched_tokens=32, max_num_seqs=8)).generate(PROMPTS, sp)
    want = LLMEngine(merged, EngineConfig(max_num_batched_tokens=32, max_num_seqs=8)).generate(PROMPTS, sp)
    assert got.completion_ids == want.completion_ids
    worst = max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs) for a, b in zip(x, y))
    assert worst < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_loads_the_saved_adapters_onto_the_transformers_model(tmp_path, family):
    peft = pytest.importorskip("peft")
    import transformers

    folder = tiny_hf_folder(tmp_path, family)
    model, _ = with_adapters(folder, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 60, (2, 7))
    with torch.no_grad():
        ours, theirs = model.logits(ids), peft_model(ids).logits
    assert (ours - theirs).abs().max() < ATOL


def test_a_peft_lora_config_is_accepted_as_trl_takes_it():
    peft = pytest.importorskip("peft")
    spec = LoraSpec.of(peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                       task_type="CAUSAL_LM"))
    assert (spec.r, spec.lora_alpha, spec.lora_dropout, spec.scaling) == (16, 32, 0.05, 2.0)
    assert spec.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="unknown LoRA target_modules \\['lm_head'\\]"):
        LoraSpec.of({"r": 4, "target_modules": ["lm_head"]})


def test_a_grpo_step_trains_the_adapters_only_and_the_engine_sees_them_in_place(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", chat_template=CHAT_TEMPLATE))
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=4,
                        seed=0, learning_rate=5e-2,
                        peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                        beta=0.04, rollout="native")
    base = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters() if "lora" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}
    assert module.ref_model is None  # beta > 0 with LoRA: the base (adapters off) is the reference
    prompts = [[5, 6, 7]] * 2
    sp = SamplingParams(max_tokens=6, temperature=0, seed=0)
    module.setup("fit")
    before = module.rollout.generate(prompts, sp)
    fit(module, toy_rows(8), 2, tmp_path / "logs")
    for n, p in model.named_parameters():
        if n in base:
            assert p.data_ptr() == base[n][0] and torch.equal(p, base[n][1]), f"{n} changed"
    assert any(not torch.equal(p, lora[n]) for n, p in model.named_parameters() if n in lora), "no adapter moved"
    assert module.rollout.engine.model is model  # the engine runs the module's own modules and parameters
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.mul_(-50.0)  # an update as large as it takes to change greedy tokens, in place
    after = module.rollout.generate(prompts, sp)
    assert after.completion_ids != before.completion_ids
