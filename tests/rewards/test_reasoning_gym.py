"""reasoning-gym tasks as a data source and their own verifiers as a reward: a right answer scores 1, a wrong
one or none scores as the task's verifier says; the difficulty is the generator's config; another split is
another draw."""
import pytest

from rlcu.data.sources import build_dataset
from rlcu.rewards.base import resolve_reward

pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize("task, config", [("basic_arithmetic", {"min_terms": 2, "max_terms": 3}),
                                          ("spell_backward", {}), ("countdown", {})])
def test_the_tasks_own_verifier_scores_the_answer_in_tags(task, config):
    rows = build_dataset("reasoning_gym", {"task": task, "n": 5, "seed": 3, "config": config})
    assert len(rows) == 5 and "<answer>" in rows[0]["prompt"][-1]["content"]
    reward = resolve_reward("reasoning_gym")
    answers = list(rows["answer"])
    completions = [f"thinking... <answer>{a}</answer>" for a in answers] + ["<answer>zzz</answer>", answers[0]]
    scores = reward.fn(["p"] * 7, completions, [[1]] * 7, rg_entry=list(rows["rg_entry"]) + list(rows["rg_entry"])[:2])
    assert scores[:5] == [1.0] * 5 and scores[5] < 0.5 and scores[6] == 0.0  # no tags: no answer


def test_difficulty_and_splits_change_the_draw():
    easy = build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 20, "config": {"min_terms": 2,
                                                                                          "max_terms": 2}})
    hard = build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 20, "config": {"min_terms": 5,
                                                                                          "max_terms": 5}})
    def operators(rows):
        return {sum(r["prompt"][-1]["content"].split("\n")[0].count(f" {op} ") for op in "+-*/") for r in rows}

    assert operators(easy) == {1} and operators(hard) == {4}
    test = build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 20, "split": "test"})
    assert list(test["answer"]) != list(build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 20})["answer"])


def test_format_score_credits_a_wrong_answer_in_tags_only():
    rows = build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 2, "seed": 3,
                                           "instruction": "Answer as <answer>7</answer>."})
    assert rows[0]["prompt"][-1]["content"].endswith("\nAnswer as <answer>7</answer>.")
    reward = resolve_reward({"name": "reasoning_gym", "init_args": {"format_score": 0.1}})
    right = f"<answer>{rows[0]['answer']}</answer>"
    completions = [right, "<answer>zzz</answer>", "no tags at all", "<answer>unclosed"]
    scores = reward.fn(["p"] * 4, completions, [[1]] * 4, rg_entry=[rows[0]["rg_entry"]] * 4)
    assert scores == [1.0, 0.1, 0.0, 0.0]
    with pytest.raises(ValueError, match="format_score must be in"):
        resolve_reward({"name": "reasoning_gym", "init_args": {"format_score": 1.0}})


def test_the_docs_example_builds_its_rows_and_reward():
    import re
    from pathlib import Path

    import yaml

    from rlcu.rewards.base import resolve_rewards

    docs = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", docs, re.S) if "reasoning_gym" in b)
    example = yaml.safe_load(block)
    rows = build_dataset(example["data"]["dataset"], {**example["data"]["dataset_args"], "n": 3})
    (reward,) = resolve_rewards(example["model"]["rewards"])
    assert "<answer>7</answer>" in rows[0]["prompt"][-1]["content"]
    assert reward.fn(["p"], ["<answer>no</answer>"], [[1]], rg_entry=[rows[0]["rg_entry"]]) == [0.1]


def test_answer_from_last_number_scores_the_last_number_with_the_tasks_verifier():
    rows = build_dataset("reasoning_gym", {"task": "basic_arithmetic", "n": 3, "seed": 4,
                                           "instruction": "Give only the final number."})
    reward = resolve_reward({"name": "reasoning_gym", "init_args": {"answer_from": "last_number"}})
    a = rows[0]["answer"]
    completions = [f"First 3, then {a}.", f"{a} or 12345", "no number", f"<answer>{a}</answer> 0"]
    scores = reward.fn(["p"] * 4, completions, [[1]] * 4, rg_entry=[rows[0]["rg_entry"]] * 4)
    assert scores[0] == 1.0 and scores[1] < 1.0 and scores[2] == 0.0 and scores[3] < 1.0
    with pytest.raises(ValueError, match="answer_from must be one of tags, last_number"):
        resolve_reward({"name": "reasoning_gym", "init_args": {"answer_from": "boxed"}})
    with pytest.raises(ValueError, match="format_score credits answers inside <answer> tags"):
        resolve_reward({"name": "reasoning_gym", "init_args": {"answer_from": "last_number", "format_score": 0.1}})
