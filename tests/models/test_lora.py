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


def test_adapters_are_off_only_in_the_thread_that_turned_them_off(tmp_path):
    """The KL reference (adapters off) may run while the engine decodes on the adapters in another thread
    (streaming's decode_steps_during_training)."""
    import threading

    model, _ = with_adapters(tiny_hf_folder(tmp_path, "llama"))
    ids = torch.randint(0, 60, (2, 7))
    with torch.no_grad():
        on = model.logits(ids)
        elsewhere = []
        with lora_disabled(model):
            off = model.logits(ids)
            worker = threading.Thread(target=lambda: elsewhere.append(model.logits(ids)))
            worker.start()
            worker.join()
        assert torch.equal(model.logits(ids), on)  # back on after the block
    assert (on - off).abs().max() > 1e-3 and torch.equal(elsewhere[0], on)


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


def with_expert_adapters(folder, parameters, seed=0):
    """LoRA on the experts' stacked projections (PEFT's target_parameters) and q_proj, B random."""
    from rlcu.models.lora import expert_adapters

    model, tok = load_model(folder)
    add_lora(model, {"r": 2, "lora_alpha": 6, "target_modules": ["q_proj"], "target_parameters": parameters})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in [m.lora for _, m in adapters(model)] + [a for _, m in expert_adapters(model)
                                                              for a in m.lora.values()]:
            lora.lora_B.copy_(0.1 * torch.randn(lora.lora_B.shape, generator=g))
    return model.eval(), tok


EXPERT_TARGETS = [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["mlp.experts.down_proj"],
                  ["experts.gate_up_proj"]]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmoe", "qwen2_moe"])
@pytest.mark.parametrize("parameters", EXPERT_TARGETS, ids=["both", "down", "gate_up"])
def test_lora_on_experts_equals_the_merged_model_and_loads_in_peft(tmp_path, family, parameters):
    """Per-expert adapters through the grouped GEMM, with and without gradients, against the merged model; saved
    as PEFT's ParamWrapper saves them, PEFT puts them on transformers' model with the same logits (gpt-oss: its
    interleaved gate/up rows)."""
    peft = pytest.importorskip("peft")
    import transformers

    folder = tiny_hf_folder(tmp_path, family)
    model, _ = with_expert_adapters(folder, parameters)
    merged = copy.deepcopy(model)
    merge_lora(merged)
    ids = torch.randint(0, 60, (3, 9))
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert (model.logits(ids) - merged.logits(ids)).abs().max() < ATOL
    base, _ = load_model(folder)
    assert (model.logits(ids) - base.logits(ids)).abs().max() > 1e-3  # the experts' adapters change the output
    with lora_disabled(model):
        assert (model.logits(ids) - base.logits(ids)).abs().max() < ATOL
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids).logits
        assert (model.logits(ids) - theirs).abs().max() < ATOL


def test_lora_on_experts_trains_in_a_grpo_step(tmp_path):
    from rlcu.models.lora import expert_adapters
    from tests.helpers import varied_reward

    model, tok = load_model(tiny_hf_folder(tmp_path, "qwen3_moe"))
    module = GRPOModule(model, tokenizer=tok, rewards=[varied_reward], num_generations=4, max_completion_length=4,
                        learning_rate=1e-2, peft_config={"r": 2, "lora_alpha": 4, "target_modules": "all-linear",
                                                         "target_parameters": ["mlp.experts.gate_up_proj",
                                                                               "mlp.experts.down_proj"]})
    experts = [a for _, m in expert_adapters(module.policy) for a in m.lora.values()]
    before = [a.lora_B.detach().clone() for a in experts]
    frozen = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    assert all(not torch.equal(b, a.lora_B) for b, a in zip(before, experts))
    assert all(torch.equal(p, dict(module.policy.named_parameters())[n]) for n, p in frozen.items())


def test_expert_lora_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown LoRA target_parameters \\['mlp.gate.weight'\\]"):
        LoraSpec.of({"target_parameters": ["mlp.gate.weight"]})
    with pytest.raises(ValueError, match="takes no lora_dropout"):
        LoraSpec.of({"target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.05})
    dense, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    with pytest.raises(ValueError, match="this model has no experts; leave target_parameters unset"):
        add_lora(dense, {"target_parameters": ["mlp.experts.down_proj"]})


def test_granite_moe_expert_adapters_merge_and_say_why_peft_cannot_take_them(tmp_path):
    """Granite-MoE's checkpoints name their experts `block_sparse_moe.input_linear`: the adapters train and merge,
    and saving them for PEFT is refused in one line naming the way out."""
    model, _ = with_expert_adapters(tiny_hf_folder(tmp_path, "granitemoe"), ["mlp.experts.down_proj"])
    merged = copy.deepcopy(model)
    merge_lora(merged)
    ids = torch.randint(0, 60, (2, 7))
    assert (model.logits(ids) - merged.logits(ids)).abs().max() < ATOL
    with pytest.raises(ValueError, match="granitemoe's checkpoints name the experts' down_proj otherwise.*rlcu export"):
        save_adapter(model, tmp_path / "adapter")


def test_expert_adapters_of_any_rank_take_torchs_grouped_gemm(monkeypatch):
    """torch's grouped GEMM wants 16-byte row strides (a rank of 4 in bf16 is 8 bytes): the rank is padded with
    zeros for it, and the update equals the per-expert loop's. The CPU runs torch's grouped GEMM here, as the GPU
    does."""
    import rlcu.models.moe as moe
    from rlcu.models.lora import ExpertAdapter

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped GEMM")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 24, 16, generator=g, dtype=torch.bfloat16)
    adapter = ExpertAdapter(weight, LoraSpec(r=4, lora_alpha=8))
    with torch.no_grad():
        adapter.lora_B.normal_(generator=g)
    rows, counts = torch.randn(10, 16, generator=g, dtype=torch.bfloat16), torch.tensor([3, 0, 7])
    y = torch.zeros(10, 24, dtype=torch.bfloat16)
    loop = adapter.add_to(y, rows, counts.tolist())
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype: dtype == torch.bfloat16)
    assert moe.grouped(rows)
    assert torch.allclose(adapter.add_to(y, rows, counts).float(), loop.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj"], ["q_proj", "v_proj"], ["k_proj"]])
def test_exact_modes_column_maps_give_the_block_diagonal_b_also_for_an_adapter_made_on_the_meta_device(targets):
    """Exact mode reads B through per-column maps (`LoraAdapter.column_maps`); the block-diagonal B they describe is
    the one the default path assembles (`block_diagonal_b`), untargeted parts zero. They come from the part sizes
    alone, so an adapter made on the meta device (a tensor-parallel model is built there) has them right."""
    from rlcu.kernels.matmul import LowRank
    from rlcu.models.fused_linear import FusedLinear
    from rlcu.models.lora import LoraAdapter

    spec = LoraSpec.of({"r": 3, "lora_alpha": 6, "target_modules": targets})
    parts = {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    adapter = LoraAdapter(FusedLinear(6, parts, bias=False), spec, [p for p in parts if p in targets])
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape))
    h = torch.randn(5, adapter.lora_A.shape[0])
    block = LowRank(h, adapter.lora_B, 1.0, *adapter.column_maps(torch.device("cpu"))).block_diagonal()
    assert torch.equal(block, adapter.block_diagonal_b())
    with torch.device("meta"):
        on_meta = LoraAdapter(FusedLinear(6, parts, bias=False), spec, [p for p in parts if p in targets])
    assert all(torch.equal(a, b) for a, b in zip(on_meta.column_maps(torch.device("cpu")),
                                                  adapter.column_maps(torch.device("cpu"))))
