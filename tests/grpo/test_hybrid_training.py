"""GRPO on linear-attention hybrids: Qwen3-Next's tiny random model (Gated DeltaNet layers, gated attention, routed
and shared experts) trains through Lightning, and its sampler's logprobs equal the trainer's within kernel
arithmetic (exact mode: tests/grpo/test_module.py)."""
import pytest
import torch

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.helpers import fit, match_target, tiny_hf_folder, toy_rows


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_grpo_steps_train_the_linear_attention_layers(tmp_path, family):
    torch.manual_seed(0)
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", family, layers=3))
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=6,
                        learning_rate=1e-2, micro_batch_size=3, temperature=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".linear_attn." in n}
    metrics = fit(module, toy_rows(4), steps=2, log_dir=tmp_path)
    mismatch = [m["logprob_mismatch/max"] for m in metrics if "logprob_mismatch/max" in m]
    assert mismatch and max(mismatch) < 1e-4  # the engine's recurrent state against training's chunked form
    after = dict(model.named_parameters())
    changed = {n.rsplit(".", 1)[-1] for n in before if not torch.equal(before[n], after[n])}
    assert {"A_log", "dt_bias", "weight"} <= changed
