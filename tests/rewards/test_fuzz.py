"""Property-based tests with malformed input: answer extraction, the reward contract and the config
loader either answer or raise a clear error; none crashes otherwise or hangs (deadlines)."""
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcu import cli
from rlcu.rewards.base import RewardError, resolve_rewards
from rlcu.rewards.countdown import CountdownEquation
from rlcu.rewards.math import answers_match, extract_answer
from rlcu.rewards.scoring import score

MATHY = st.text(alphabet="0123456789+-*/^().,{}\\boxed frac sqrt e x=$ \n", max_size=60)
ANY_VALUE = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=5),
                      st.booleans(), st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=2000, derandomize=True)
@given(st.one_of(st.text(max_size=200), MATHY), st.one_of(st.text(max_size=30), MATHY, st.integers()))
def test_answer_extraction_and_matching_never_crash_or_hang(text, reference):
    answer = extract_answer(text)
    assert answer is None or isinstance(answer, str)
    assert answers_match(answer, reference) in (True, False)


@settings(max_examples=200, deadline=2000, derandomize=True)
@given(MATHY, st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(-50, 1000))
def test_countdown_reward_scores_any_completion(text, nums, target):
    value = CountdownEquation()(["p"], [f"<answer>{text}</answer>"], [[1]], nums=[nums], target=[target])[0]
    assert value in (0.0, 1.0)


@settings(max_examples=300, deadline=2000, derandomize=True)
@given(st.lists(ANY_VALUE, min_size=0, max_size=4))
def test_reward_outputs_are_validated(values):
    def reward(completions, **kw):
        return values

    try:
        out = score(resolve_rewards([reward]), ["p"] * 3, ["a", "b", "c"], [[1]] * 3, {})
    except RewardError as e:
        assert "reward 'reward'" in str(e)
        return
    assert out.shape == (3, 1)
    assert all(math.isnan(float(x)) or math.isfinite(float(x)) for x in out[:, 0])
    assert len(values) == 3 and all(v is None or isinstance(v, (int, float)) for v in values)


CONFIG_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                       st.text(max_size=8)),
                             lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                             max_leaves=6)
SECTIONS = st.dictionaries(st.sampled_from(["trainer", "model", "data", "seed_everything", "bogus"]),
                           st.one_of(CONFIG_VALUES, st.dictionaries(
                               st.sampled_from(["max_steps", "learning_rate", "rewards", "dataset", "batch_size",
                                                "num_generations", "nonsense"]), CONFIG_VALUES, max_size=3)),
                           max_size=3)


@settings(max_examples=40, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(SECTIONS, st.text(max_size=80)))
def test_config_loader_gives_a_clear_error_or_a_config(tmp_path, document):
    path = tmp_path / "fuzz.yaml"
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    try:
        cli.build_cli(["fit", "--config", str(path)], parse_only=True)
    except SystemExit as e:  # jsonargparse's usage error: it printed what is wrong
        assert e.code == 2
    except cli.user_errors():
        pass
