"""Environments: a TRL-style `environment_factory` class (reset, public methods as tools, get_reward),
a dict of them chosen by the `environment` column, and a `TextEnvironment` that answers each turn (the
guess-number plugin, found through the `rlcu.environments` entry point)."""
import pytest
from rlcu_guess_number import GuessNumber
from transformers import AutoTokenizer

from rlcu import plugins
from rlcu.agents import AgentOptions, Environments, EpisodeRunner
from rlcu.contracts import SamplingParams
from tests.agents.scripted import ScriptedRollout, call


class CounterEnv:  # written as TRL's docs describe an environment_factory class
    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return " Count with the tool."

    def increment(self, step: int) -> int:
        """
        Adds to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter's new value.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class EchoEnv:
    def reset(self, **kwargs) -> None:
        self.said = []

    def echo(self, text: str) -> str:
        """
        Repeats the text.

        Args:
            text: What to repeat.
        """
        self.said.append(text)
        return text


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return AutoTokenizer.from_pretrained(smollm2_folder)


def episodes(tokenizer, rows, factory, script, max_tokens=300):
    agent = AgentOptions.build(tokenizer, environment_factory=factory, tool_format_name="hermes",
                               max_completion_length=max_tokens)
    runner = EpisodeRunner(rows, agent)
    out = ScriptedRollout(tokenizer, script).generate(runner.prompt_ids, SamplingParams(max_tokens=max_tokens), runner)
    return runner, out


def test_a_trl_environment_class_runs_unchanged(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Count to 5."}]}] * 2
    script = lambda history, turn: call("increment", step=turn + 2) if turn < 2 else "Done.<|im_end|>"  # noqa: E731
    runner, out = episodes(tokenizer, rows, CounterEnv, script)
    assert "Count to 5. Count with the tool." in tokenizer.decode(runner.prompt_ids[0])  # reset's text appended
    assert [e.count for e in runner.environments] == [5, 5] and runner.environments[0] is not runner.environments[1]
    (name, reward), = runner.options.environments.rewards()
    assert name == "CounterEnv" and reward(environments=runner.environments) == [5.0, 5.0]
    assert [m["content"] for m in runner.completions[0] if m["role"] == "tool"] == ["2", "5"]
    # instances are pooled: the next batch resets them instead of making new ones
    again = EpisodeRunner(rows, runner.options)
    assert again.environments == runner.environments


def test_a_dict_of_environments_is_chosen_per_row(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "go"}], "environment": "counter"},
            {"prompt": [{"role": "user", "content": "go"}], "environment": "echo"}]
    agent = AgentOptions.build(tokenizer, environment_factory={"counter": CounterEnv, "echo": EchoEnv},
                               tool_format_name="hermes")
    runner = EpisodeRunner(rows, agent)
    text = [tokenizer.decode(ids) for ids in runner.prompt_ids]
    assert '"increment"' in text[0] and '"echo"' not in text[0] and '"echo"' in text[1]
    with pytest.raises(ValueError, match="environment='chess'"):
        EpisodeRunner([{"prompt": rows[0]["prompt"], "environment": "chess"}], agent)


def test_an_environment_without_reset_is_an_error():
    class NoReset:
        def move(self, x: int) -> int:
            """Moves.

            Args:
                x: where
            """
            return x

    with pytest.raises(ValueError, match="no reset"):
        Environments(NoReset)


def test_a_text_environment_answers_each_turn_until_done(tokenizer):
    assert plugins.available("environments")["guess_number"].load() is GuessNumber
    rows = [{"prompt": [{"role": "user", "content": "Guess."}], "target": 30}]
    guesses = iter(["50", "25", "I think 30"])
    runner, out = episodes(tokenizer, rows, {"name": "guess_number", "init_args": {"max_guesses": 5}},
                           lambda history, turn: next(guesses) + "<|im_end|>")
    assert [m["content"] for m in runner.completions[0]] == ["50", "Lower.", "25", "Higher.", "I think 30"]
    env = runner.environments[0]
    assert env.solved and env.get_reward() == 1.0 and env.guesses == 3
    appended = [t for t, m in zip(out.completion_ids[0], out.tool_mask[0]) if m == 0]
    assert tokenizer.decode(appended).count("<|im_start|>user\n") == 2
    assert runner.metrics()["episodes/mean_turns"] == 3


def test_a_text_environment_that_runs_out_of_guesses_ends_the_episode(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Guess."}], "target": 30}]
    runner, _ = episodes(tokenizer, rows, {"name": "guess_number", "init_args": {"max_guesses": 2}},
                         lambda history, turn: "1<|im_end|>")
    assert runner.metrics()["episodes/mean_turns"] == 2 and runner.environments[0].get_reward() == 0.0


def test_tool_use_rewards_a_result_followed_by_an_answer():
    from rlcu.rewards.tools import ToolUse

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    answered = [call, {"role": "tool", "name": "f", "content": "56088"}, {"role": "assistant", "content": "56088"}]
    again = answered[:2] + [call]
    failed = [call, {"role": "tool", "name": "f", "content": "{'error': 'boom'}"}, answered[2]]
    assert ToolUse()(["p"] * 4, [answered, again, failed, "text"], [[1]] * 4) == [1.0, 0.0, 0.0, 0.0]
