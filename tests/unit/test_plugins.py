import pytest

from rlcu import plugins
from rlcu.rewards.base import resolve_reward


def test_builtin_rewards_and_rollouts_are_entry_points():
    assert {"math_answer", "format_tags", "countdown", "overlong_penalty"} <= set(plugins.available("rewards"))
    assert "reference" in plugins.available("rollouts")


def test_first_party_plugin_package_is_found_by_short_name():
    # installed by the README's set-up from plugins/rlcu-repetition, exactly as a third-party package
    assert "repetition_penalty" in plugins.available("rewards")
    r = resolve_reward({"name": "repetition_penalty", "weight": 0.5, "init_args": {"ngram_size": 2}})
    assert r.name == "repetition_penalty" and r.weight == 0.5
    got = r.fn(prompts=["p"] * 2, completions=["a b a b", "a b c d"], completion_ids=[[], []])
    assert got == pytest.approx([-1 / 3, 0.0])


def test_import_paths_work_without_registration():
    assert plugins.load("rewards", "rlcu.rewards.length:overlong_penalty")(5, 10, 4) == 0.0
    assert plugins.load("rewards", "rlcu.rewards.length.overlong_penalty")(8, 10, 4) == -0.5


def test_unknown_plugin_lists_the_available_ones():
    with pytest.raises(plugins.UnknownPluginError, match=r"unknown reward 'acurracy'; available: .*math_answer"):
        plugins.load("rewards", "acurracy")
    with pytest.raises(plugins.UnknownPluginError, match="cannot import"):
        plugins.load("rollouts", "nowhere.module:thing")
