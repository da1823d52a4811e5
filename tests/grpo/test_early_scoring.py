"""score_during_generation: completions are scored as they end, while the rest decode; the update is the one
scoring after the rollout gives; errors and unsupported set-ups are named."""
import sys
import threading

import pytest
import torch

from rlcu.contracts import Turn
from rlcu.engine.threads import SWITCH_INTERVAL_S
from rlcu.grpo.batch import ScoredRollout
from rlcu.grpo.early_scoring import EarlyScorer
from rlcu.grpo.module import GRPOModule
from rlcu.rewards.base import RewardError
from rlcu.rollout.reference import ReferenceRollout
from tests.helpers import fit, match_target, toy_model, toy_rows


def scored_rows(rows, ids):
    return ScoredRollout([f"p{r}" for r in rows], [str(i) for i in ids], torch.tensor([[float(len(i))] for i in ids]))


def test_completions_are_scored_as_they_end_and_results_come_in_row_order():
    calls, first_call, go_on, interval = [], threading.Event(), threading.Event(), sys.getswitchinterval()

    def score_rows(rows, ids):
        calls.append(list(rows))
        first_call.set()
        go_on.wait(10)  # a slow reward: what ends meanwhile waits for the next call
        return scored_rows(rows, ids)

    with EarlyScorer(score_rows, num_rows=4) as scorer:
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        scorer.on_finished(Turn(2, [8], "stop"))
        assert first_call.wait(10) and calls == [[2]]  # scored while the other three "decode"
        scorer.on_finished(Turn(0, [5], "stop"))
        scorer.on_finished(Turn(3, [7, 7, 7], "length"))
        go_on.set()
        scorer.on_finished(Turn(1, [5, 6], "stop"))
        out = scorer.result([[5], [5, 6], [8], [7, 7, 7]], None)
    assert sys.getswitchinterval() == interval  # given back
    assert out.prompts == ["p0", "p1", "p2", "p3"] and out.rewards[:, 0].tolist() == [1.0, 2.0, 1.0, 3.0]
    assert calls[0] == [2] and sorted(r for c in calls for r in c) == [0, 1, 2, 3] and len(calls) <= 3
    assert scorer.rows_scored == 4


def test_unreported_completions_are_scored_from_the_rollout_and_a_reward_error_scores_the_batch_again():
    def score_rows(rows, ids):
        if 1 in rows:
            raise RewardError("reward 'r' raised ValueError: bad")
        return scored_rows(rows, ids)

    with EarlyScorer(score_rows, num_rows=2) as scorer:
        scorer.on_finished(Turn(0, [4, 4], "stop"))
        assert scorer.result([[4, 4], [9]], lambda: "scored again") == "scored again"  # row 1 failed: all again
    with EarlyScorer(scored_rows, num_rows=2) as scorer:
        scorer.on_finished(Turn(1, [3], "stop"))  # reported otherwise than the rollout's result: scored again
        out = scorer.result([[1], [2, 2]], None)
    assert out.rewards[:, 0].tolist() == [1.0, 2.0]

    def interrupted(rows, ids):
        raise KeyboardInterrupt

    with EarlyScorer(interrupted, num_rows=1) as scorer:
        scorer.on_finished(Turn(0, [3], "stop"))
        with pytest.raises(KeyboardInterrupt):  # anything but a reward's error: raised in the caller's thread
            scorer.result([[3]], None)


def test_scoring_during_generation_gives_the_same_update(tmp_path):
    runs = {}
    for overlap in (False, True):
        model, tok = toy_model(tmp_path / "m")  # the same seeded weights both times
        module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=6,
                            learning_rate=1e-2, micro_batch_size=8, score_during_generation=overlap)
        metrics = [m for m in fit(module, toy_rows(8), steps=2, log_dir=tmp_path / str(overlap)) if "reward" in m]
        runs[overlap] = metrics, module.last_rollout, [p.detach().clone() for p in module.policy.parameters()]
    (plain, plain_last, plain_w), (early, early_last, early_w) = runs[False], runs[True]
    for a, b in zip(plain, early):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"]
        assert 0.0 <= b["scored_during_generation"] <= 1.0 and "scored_during_generation" not in a
    assert plain_last.completions == early_last.completions and plain_last.prompts == early_last.prompts
    assert torch.equal(plain_last.rewards, early_last.rewards)
    assert all(torch.equal(a, b) for a, b in zip(plain_w, early_w))


def test_a_failing_reward_names_its_rows(tiny, tmp_path):
    def fails_on_row_1(prompts, completions, **kwargs):
        if "p1" in str(prompts):
            raise ValueError("no answer")
        return [0.0] * len(completions)

    rows = [{"prompt": f"p{i}", "target": "x"} for i in range(8)]
    module = GRPOModule(tiny[0], tokenizer=tiny[1], rewards=[fails_on_row_1], num_generations=2,
                        max_completion_length=4, micro_batch_size=8, score_during_generation=True)
    # the error scoring after the rollout raises: the batch's sample number, not the worker's call's
    with pytest.raises(RewardError, match=r"fails_on_row_1.*raised ValueError: no answer on sample 2 \(prompt 'p1'"):
        fit(module, rows, steps=1, log_dir=tmp_path, batch_size=4)


def test_unsupported_set_ups_are_named(tiny):
    with pytest.raises(ValueError, match="score_during_generation needs a rollout backend .* ReferenceRollout"):
        GRPOModule(tiny[0], tokenizer=tiny[1], rewards=[match_target], rollout=ReferenceRollout(),
                   score_during_generation=True)

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    with pytest.raises(ValueError, match="episodes .* are scored after the rollout"):
        GRPOModule(tiny[0], tokenizer=tiny[1], rewards=[match_target], tools=[add], tool_format="hermes",
                   score_during_generation=True)
