"""A tiny random model learns a verifiable toy task under GRPO, for every loss type and variant:
prompt 'tD', reward = fraction of the 4 completion tokens equal to t(D+8). Chance level is ~1/64."""
import pytest

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.helpers import fit, match_target, tiny_hf_folder, toy_rows

STEPS = 80

VARIANTS = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none", learning_rate=5e-2),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "kl+reuse": dict(loss_type="dapo", beta=0.04, num_iterations=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mean_reward_rises(tmp_path, variant):
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    options = dict(num_generations=8, max_completion_length=4, learning_rate=2e-2, micro_batch_size=16, seed=0)
    options.update(VARIANTS[variant])
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], **options)
    rewards = [m["reward"] for m in fit(module, toy_rows(4 * STEPS), STEPS, tmp_path / "logs") if "reward" in m]
    assert len(rewards) == STEPS // VARIANTS[variant].get("num_iterations", 1)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1, f"{variant}: the task should start near chance, got {first:.3f}"
    assert last > first + 0.25, f"{variant}: mean reward went from {first:.3f} to only {last:.3f}"
