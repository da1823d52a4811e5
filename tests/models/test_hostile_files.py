"""Model files from outside: a config with sizes no model has, a truncated safetensors file, or weights of the
wrong shape fail before any allocation of that size, with one line naming the field, the file or the tensor."""
import json

import pytest

from rlcu.models import load_model
from tests.helpers import tiny_hf_folder


@pytest.mark.parametrize("field, value, says", [
    ("vocab_size", 10**9, "vocab_size=1000000000 is not a size rlcu can build"),
    ("num_hidden_layers", 10**5, "num_hidden_layers=100000 is not a size rlcu can build"),
    ("hidden_size", "48", "hidden_size='48' is not a size rlcu can build"),
])
def test_a_config_with_absurd_sizes_fails_before_allocating(tmp_path, field, value, says):
    folder = tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: {says}"):
        load_model(folder)


def test_a_head_count_that_does_not_divide_the_hidden_size_is_named(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=50, head_dim=None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size 50 is not a multiple of num_attention_heads 6"):
        load_model(folder)


def test_a_truncated_safetensors_file_names_the_tensor(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' ends at byte \d+ of \d+ data bytes; the "
                                         "file is truncated or damaged"):
        load_model(folder)
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="its header claims"):
        load_model(folder)


def test_weights_of_the_wrong_shape_name_the_tensor(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.gate_up_proj.weight \(208, 48\) \(config.json "
                                         r"wants \(224, 48\)\) does not fit the config"):
        load_model(folder)


@pytest.fixture
def smollm2_gguf(monkeypatch, tmp_path):
    """The embedded SmolLM2 GGUF, with conversions cached under tmp_path."""
    from rlcu.models.embedded import fetch_gguf

    path = fetch_gguf("smollm2-135m-instruct")
    monkeypatch.setenv("RLCU_CACHE", str(tmp_path / "cache"))
    return path


def test_a_truncated_gguf_names_the_tensor_and_leaves_no_partial_folder(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:50_000_000])
    with pytest.raises(ValueError, match=r"cut.gguf: tensor 'blk\.\d+\.[a-z_.]+' ends at byte \d+ of a file of "
                                         "50000000; the file is truncated"):
        load_model(cut)
    (tmp_path / "header.gguf").write_bytes(smollm2_gguf.read_bytes()[:100])
    with pytest.raises(ValueError, match="header.gguf is not a readable GGUF file"):
        load_model(tmp_path / "header.gguf")
    assert not list((tmp_path / "cache").glob("gguf/*"))


def test_a_gguf_whose_tensors_do_not_fit_its_metadata_names_the_tensor(smollm2_gguf, tmp_path):
    """Its metadata says a hidden size of 512 (8 heads, 2 KV heads), its tensors hold 576: transformers would
    re-initialise every such tensor at random and go on."""
    import gguf

    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(smollm2_gguf.read_bytes())
    reader = gguf.GGUFReader(wrong, "r+")
    for key, value in [("llama.embedding_length", 512), ("llama.attention.head_count", 8),
                       ("llama.attention.head_count_kv", 2)]:
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
    reader.data.flush()
    del reader
    with pytest.raises(ValueError, match=r"wrong.gguf: tensor model.embed_tokens.weight \(49152, 576\) \(its metadata "
                                         r"wants \(49152, 512\)\) does not fit the file's metadata, and 271 more"):
        load_model(wrong)
    assert not list((tmp_path / "cache").glob("gguf/*"))


def test_code_from_a_model_folder_runs_only_with_trust_remote_code(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "rlcu_remote_probe", "architectures": ["ProbeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig",
                     "AutoModelForCausalLM": "configuration_probe.ProbeForCausalLM"}}))
    (folder / "configuration_probe.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class ProbeConfig(PretrainedConfig):\n    model_type = 'rlcu_remote_probe'\n"
        "class ProbeForCausalLM:\n    pass\n")
    with pytest.raises(ValueError, match="rlcu runs it only with trust_remote_code=True"):
        load_model(folder)
    assert not marker.exists()
    with pytest.raises(Exception):  # the probe is no model; what matters is that its code ran when asked to
        load_model(folder, trust_remote_code=True)
    assert marker.exists()
