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
