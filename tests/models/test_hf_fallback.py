"""The transformers fallback: an architecture with no native family trains on its own HF modules, its
rollouts equal the model's own greedy generate, the sampler's logprobs equal the training forward's, and a
model that transformers cannot load either is a one-line error that says so."""
import json

import pytest
import torch
import transformers

from rlcu.grpo.logprobs import completion_logprobs
from rlcu.grpo.module import GRPOModule
from rlcu.models import hf_decode, load_model
from rlcu.models.hf import HFCausalLM, HFIncremental
from rlcu.rollout import SamplingParams
from rlcu.rollout.reference import ReferenceRollout
from tests.helpers import (
    CHAT_TEMPLATE,
    EOS,
    FALLBACK_FAMILIES,
    PROMPTS,
    first_token_value,
    fit,
    match_target,
    reference_generate,
    tiny_hf_folder,
    toy_rows,
)

FAMILIES = sorted(FALLBACK_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollouts_equal_the_models_own_greedy_generate(tmp_path, family, caplog):
    folder = tiny_hf_folder(tmp_path, family)
    with caplog.at_level("WARNING"):
        model, _ = load_model(folder)
    assert isinstance(model, HFCausalLM) and "transformers fallback" in caplog.text
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = reference_generate(model, PROMPTS, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS]))
    for prompt, got in zip(PROMPTS, out.completion_ids):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                           pad_token_id=62)[0, len(prompt):].tolist()
        assert got == (want[:want.index(EOS) + 1] if EOS in want else want)
    # GPT-NeoX and Mixtral (its sliding window too) decode over rlcu's static cache; Falcon, whose modules do not
    # declare transformers' attention interface, over transformers' cache
    assert isinstance(model.incremental(1, 8), hf_decode.StaticDecoder) == (family != "falcon")


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_logprobs_equal_the_training_forward(tmp_path, family):
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    sp = SamplingParams(max_tokens=8, temperature=0.8, stop_token_ids=[EOS], seed=1)
    out = reference_generate(model, PROMPTS, sp)
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), sp.temperature)
        assert (ref[0] - torch.tensor(lp)).abs().max() < 1e-4


def test_a_grpo_step_trains_an_architecture_without_a_native_path(tmp_path):
    folder = tiny_hf_folder(tmp_path / "m", "gpt_neox", vocab_size=32, hidden=32, heads=4, chat_template=CHAT_TEMPLATE)
    module = GRPOModule(str(folder), rewards=[first_token_value], num_generations=4, max_completion_length=4,
                        learning_rate=1e-2, seed=0)
    assert isinstance(module.rollout, ReferenceRollout)  # "native" (the default) has no engine for it
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    rows = fit(module, toy_rows(4), 1, tmp_path / "logs", batch_size=2)
    assert any(r.get("reward") is not None for r in rows)
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert any("attention" in k for k in changed) and any("mlp" in k for k in changed)


def test_a_model_transformers_cannot_load_is_a_clear_error(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, model_type="no_such_architecture")))
    with pytest.raises(ValueError, match="transformers .* cannot load this model either.*native families: .*gemma3"):
        load_model(folder)


def test_exact_logprobs_and_lora_name_the_fallback(tmp_path):
    folder = str(tiny_hf_folder(tmp_path, "gpt_neox"))
    with pytest.raises(ValueError, match="exact_logprobs needs a native family"):
        GRPOModule(folder, rewards=[match_target], exact_logprobs=True, rollout="native")
    with pytest.raises(ValueError, match="peft_config: LoRA runs in rlcu's native families"):
        GRPOModule(folder, rewards=[match_target], peft_config={"r": 4})


def test_a_folder_without_a_tokenizer_needs_one_to_train(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    assert load_model(folder)[1] is None
    with pytest.raises(ValueError, match="has no tokenizer: save one into the folder, or pass tokenizer="):
        GRPOModule(str(folder), rewards=[match_target])


def _as_fallback(folder) -> HFCausalLM:
    """A family rlcu runs natively, driven through the fallback instead (its HF modules)."""
    return HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))


def _greedy_hf(folder, prompts, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as the rollouts here: no stop token
    return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=62)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "mistral"])
def test_the_static_cache_decodes_as_transformers_generate_across_widths(tmp_path, family, monkeypatch):
    """rlcu's attention inside the HF modules (GQA group 3 for llama, a sliding window of 5 keys for mistral),
    with cache widths 8 columns apart so one rollout crosses several (one CUDA graph each on CUDA): tokens
    equal transformers' generate, logprobs equal the training forward's."""
    monkeypatch.setattr(hf_decode, "COLS", 8)
    folder = tiny_hf_folder(tmp_path, family)
    model = _as_fallback(folder)
    assert isinstance(model.incremental(2, 40), hf_decode.StaticDecoder)
    calls = []
    monkeypatch.setattr(hf_decode.StaticDecoder, "attend", _spy(hf_decode.StaticDecoder.attend, calls))
    out = reference_generate(model, PROMPTS, SamplingParams(max_tokens=20, temperature=0))
    assert calls and model.static_decoding and model.hf.config._attn_implementation != hf_decode.NAME
    assert out.completion_ids == _greedy_hf(folder, PROMPTS, 20)
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), 1.0)
        assert (ref[0] - torch.tensor(lp)).abs().max() < 1e-4


def _spy(fn, calls):
    def spied(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return spied


def test_a_soft_capped_model_decodes_over_transformers_cache_instead(tmp_path, caplog):
    """Gemma 2's attention asks for soft-capped scores, which the static cache lacks: found at the prefill,
    said once, and the rollout still equals transformers' generate."""
    folder = tiny_hf_folder(tmp_path, "gemma2")
    model = _as_fallback(folder)
    with caplog.at_level("WARNING"):
        out = reference_generate(model, PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    assert "softcap" in caplog.text and not model.static_decoding
    assert out.completion_ids == _greedy_hf(folder, PROMPTS, 12)
    assert isinstance(model.incremental(2, 40), HFIncremental)
