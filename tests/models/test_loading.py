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
