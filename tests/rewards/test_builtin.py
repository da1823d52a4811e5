import pytest

from rlcu.rewards.base import RewardError, resolve_rewards
from rlcu.rewards.countdown import CountdownEquation
from rlcu.rewards.format import FormatTags
from rlcu.rewards.length import OverlongPenalty
from rlcu.rewards.math import MathAnswer, extract_answer
from rlcu.rewards.scoring import score


@pytest.mark.parametrize("text,answer", [
    ("The sum is 42.", "42"), ("first 3 then 1,234", "1,234"), ("so \\boxed{\\frac{3}{4}} and 7", "\\frac{3}{4}"),
    ("\\boxed{x^{2}} ok", "x^{2}"), ("no digits", None), ("-5 degrees", "-5"),
])
def test_answer_extraction(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("completion,ref,ok", [
    ("42", "42", True), ("The answer is 42.0", "42", True), ("\\boxed{0.5}", "1/2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True), ("1,000", "1000", True), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True), ("41", "42", False), ("\\boxed{9^{9^{9}}}", "1", False),
    ("\\boxed{__import__('os')}", "0", False), ("#### 18", "The answer is\n#### 18", True),
])
def test_math_answer_numeric_and_symbolic(completion, ref, ok):
    assert MathAnswer()(["q"], [completion], [[1]], answer=[ref]) == [float(ok)]


def test_math_answer_conversational_and_missing_reference():
    out = MathAnswer()(["q", "q"], [[{"role": "assistant", "content": "7"}], "7"], [[1], [1]], answer=["7", None])
    assert out == [1.0, None]
    with pytest.raises(KeyError, match="needs the dataset column 'answer'; the batch has \\['solution'\\]"):
        MathAnswer()(["q"], ["7"], [[1]], solution=["7"])


def test_format_tags():
    r = FormatTags()
    good, bad = "<think>hmm</think>\n<answer>4</answer>", "<answer>4</answer>"
    assert r(["p", "p"], [good, bad], [[], []]) == [1.0, 0.0]
    assert FormatTags(tags=["answer"])(["p"], [bad], [[]]) == [1.0]


@pytest.mark.parametrize("text,ok", [
    ("<answer>(25 - 5) * 2 + 3</answer>", True), ("<answer>(25-5)*2</answer>", False),  # 3 unused
    ("<answer>(25 - 5) * 2 + 3 + 3</answer>", False), ("thinking\n(25 - 5) * 2 + 3 = 43", True),
    ("<answer>__import__('os').system('x')</answer>", False), ("<answer>25 / 0 + 5 + 2 + 3</answer>", False),
])
def test_countdown(text, ok):
    assert CountdownEquation()(["p"], [text], [[]], nums=[[25, 5, 2, 3]], target=[43]) == [float(ok)]
    # TinyZero's partial credit goes to wrong answers inside <answer> tags only
    partial = 0.1 if "<answer>" in text else 0.0
    assert CountdownEquation(format_score=0.1)(["p"], [text], [[]], nums=[[25, 5, 2, 3]], target=[43]) == \
        [1.0 if ok else partial]


def test_countdown_format_score_must_stay_below_a_correct_answer():
    with pytest.raises(ValueError, match="format_score must be in"):
        CountdownEquation(format_score=1.0)


def test_overlong_penalty_matches_trl_formula():
    trl_rewards = pytest.importorskip("trl.rewards")
    trl_fn = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)
    ids = [[0] * n for n in (0, 5, 12, 13, 16, 20, 25)]
    assert OverlongPenalty(20, 8)(["p"] * 7, [""] * 7, ids) == pytest.approx(trl_fn(completion_ids=ids))


def test_scoring_errors_name_the_reward_and_the_sample():
    def flaky(prompts, completions, completion_ids, **kw):
        return [1.0 / (len(c) - 3) for c in completions]  # fails on a completion of length 3

    def short(prompts, completions, completion_ids, **kw):
        return [1.0]

    def wrong_type(prompts, completions, completion_ids, **kw):
        return ["yes"] * len(completions)

    args = (["p1", "p2", "p3"], ["abcd", "abc", "ab"], [[1], [2], [3]], {})
    with pytest.raises(RewardError, match=r"reward 'flaky' raised ZeroDivisionError.*on sample 1 .*completion 'abc'"):
        score(resolve_rewards([flaky]), *args)
    with pytest.raises(RewardError, match="returned 1 values for 3 completions"):
        score(resolve_rewards([short]), *args)
    with pytest.raises(RewardError, match="returned 'yes' for sample 0"):
        score(resolve_rewards([wrong_type]), *args)


def test_none_becomes_nan_and_weights_apply():
    def half(prompts, completions, completion_ids, **kw):
        return [None, 0.5]

    rewards = resolve_rewards([half, "format_tags"], weights=[2.0, 1.0])
    out = score(rewards, ["a", "b"], ["x", "y"], [[1], [2]], {})
    assert out.isnan()[0, 0] and out[1, 0] == 0.5 and [r.weight for r in rewards] == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"reward_weights has 2 value\(s\) for 1 reward\(s\) \(half\): give one "):
        resolve_rewards([half], weights=[1.0, 2.0])
