"""A TRL user's options and rewards as TRL defines them: each case below failed before rlcu took TRL's meaning."""
import pytest
import torch

from rlcu.rewards.base import resolve_reward
from tests.grpo.test_module import make
from tests.helpers import fit, match_target, toy_rows


def last_step(metrics):
    return [m for m in metrics if "reward" in m][-1]


def test_rewards_read_trainer_state_as_attributes_and_log_metrics_and_columns(tiny, tmp_path):
    seen = []

    def progress(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state["max_steps"]))
        log_metric("my/fraction_long", sum(len(c) > 3 for c in completions) / len(completions))
        log_extra("chars", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    module = make(tiny, rewards=[progress])
    step = last_step(fit(module, toy_rows(8), steps=2, log_dir=tmp_path))
    assert seen == [(0, 2), (1, 2)]  # TRL's TrainerState: the step before this one's update, and the run's steps
    assert 0.0 <= step["my/fraction_long"] <= 1.0
    assert module.last_rollout.extra["chars"] == [len(c) for c in module.last_rollout.completions]


def test_trl_booleans_and_nones_mean_what_trl_means(tiny, tmp_path):
    assert make(tiny, scale_rewards=False).options.loss.scale_rewards == "none"
    assert make(tiny, scale_rewards=True).options.loss.scale_rewards == "group"
    module = make(tiny, min_p=None)  # TRL's default: no min-p filter
    assert module.sampling_params().min_p == 0.0
    fit(module, toy_rows(4), steps=1, log_dir=tmp_path)


def test_warmup_steps_below_one_is_a_ratio_of_the_run(tiny, tmp_path):
    module = make(tiny, lr_scheduler_type="linear", warmup_steps=0.25)  # TRL's names: 1 of the 4 steps warms up
    lrs = [m["learning_rate"] for m in fit(module, toy_rows(16), steps=4, log_dir=tmp_path) if "learning_rate" in m]
    assert lrs == pytest.approx([1e-2 * f for f in (1.0, 2 / 3, 1 / 3, 0.0)])
    assert module.options.optimizer.lr_scheduler == "linear"


def test_reward_funcs_is_trls_name_of_rewards(tiny):
    assert [r.name for r in make(tiny, rewards=("math_answer",), reward_funcs=[match_target]).rewards] == \
        ["match_target"]
    with pytest.raises(ValueError, match="reward_funcs and rewards are one argument"):
        make(tiny, rewards=["format_tags"], reward_funcs=[match_target])


def test_trls_reward_names_and_factories_resolve():
    trl_rewards = pytest.importorskip("trl.rewards")
    assert resolve_reward("accuracy_reward").fn is trl_rewards.accuracy_reward
    chat = [[{"role": "assistant", "content": "so \\boxed{4}"}], [{"role": "assistant", "content": "5"}]]
    assert resolve_reward("accuracy_reward").fn(chat, solution=["4", "4"]) == [1.0, 0.0]
    # a factory with its arguments, as YAML gives them: {name: ..., init_args: {...}}
    punish = resolve_reward({"name": "get_soft_overlong_punishment",
                             "init_args": {"max_completion_len": 10, "soft_punish_cache": 4}, "weight": 0.5})
    assert punish.weight == 0.5
    assert punish.fn(completion_ids=[[1] * 5, [1] * 8, [1] * 12]) == [0.0, -0.5, -1.0]


def test_normalize_then_sum_is_trls_aggregation():
    from rlcu.grpo.loss import nanstd, normalize_then_sum

    per_func = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, float("nan")], [1.0, 1.0]])
    weights = torch.tensor([1.0, 0.5])
    adv, zero = normalize_then_sum(per_func, weights, num_generations=2)
    # TRL 1.16's steps (grpo_trainer._calculate_rewards), written out for groups of 2
    g = per_func.view(2, 2, 2)
    z = ((g - torch.nanmean(g, 1, keepdim=True)) / (nanstd(g, 1).unsqueeze(1) + 1e-4)).view(4, 2)
    summed = (z * weights).nansum(1)
    expected = (summed - summed.mean()) / (nanstd(summed) + 1e-4)
    assert torch.allclose(adv, expected) and not zero.any()
    with pytest.raises(ValueError, match="normalize_then_sum.*advantage_estimator='grpo'"):
        from rlcu.grpo.options import LossOptions

        LossOptions(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo")
