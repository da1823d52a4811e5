"""A tiny random model learns a verifiable toy task under GRPO, for every loss type and variant:
prompt 'tD', reward = fraction of the 4 completion tokens equal to t(D+8). Chance level is ~1/64."""
import pytest

from tests.helpers import TOY_STEPS, assert_rises, run_toy

VARIANTS = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "kl+reuse": dict(loss_type="dapo", beta=0.04, num_iterations=2),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),  # the ScaleRL paper's eps_max
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "rloo": dict(loss_type="dapo", advantage_estimator="rloo"),
    "reinforce_pp": dict(loss_type="dapo", advantage_estimator="reinforce_pp"),
    "top-entropy+bonus": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.001),
    "adaptive entropy": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_target=1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mean_reward_rises(tmp_path, variant):
    rewards = [m["reward"] for m in run_toy(tmp_path, **VARIANTS[variant]) if "reward" in m]
    assert len(rewards) == TOY_STEPS // VARIANTS[variant].get("num_iterations", 1)
    assert_rises(rewards, variant)


@pytest.mark.slow
def test_mean_reward_rises_with_the_native_engine(tmp_path):
    metrics = run_toy(tmp_path, rollout="native")
    assert_rises([m["reward"] for m in metrics if "reward" in m], "native")
    assert max(m["logprob_mismatch/max"] for m in metrics if "logprob_mismatch/max" in m) < 1e-4
