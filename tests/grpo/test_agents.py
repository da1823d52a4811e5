"""GRPO on episodes: TRL-style tools and environment classes, unchanged, run GRPO steps on the real
SmolLM2 on CPU; rewards get the episode's messages (and the environments); tool tokens carry no loss;
the tool metrics are logged with TRL's names."""
import pytest
import torch

from rlcu.contracts import RolloutBatch
from rlcu.grpo.batch import GRPOBatch
from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.agents.scripted import ScriptedRollout, call
from tests.agents.test_environments import CounterEnv
from tests.agents.test_episodes import multiply
from tests.helpers import fit

QUESTIONS = [{"prompt": [{"role": "user", "content": f"What is {a} * 7?"}], "answer": str(a * 7)} for a in (12, 31)]


def test_tool_tokens_carry_no_loss_and_do_not_count_as_length():
    rollout = RolloutBatch([[1, 2], [3]], [[5, 6, 7, 8], [9]], [[-1.0] * 4, [-1.0]], ["stop", "length"],
                           tool_mask=[[1, 0, 0, 1], [1]])
    batch = GRPOBatch.from_rollout(rollout, torch.zeros(2), pad_id=0)
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    assert batch.attention_mask[:, -4:].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]  # the forward still sees them
    assert batch.lengths.tolist() == [2, 1]


@pytest.mark.slow
def test_trl_style_tools_run_a_grpo_step(smollm2_folder, tmp_path):
    model, tok = load_model(smollm2_folder)
    seen = {}

    def correct(prompts, completions, completion_ids, answer, **kwargs):  # a TRL reward over message lists
        seen["completions"] = completions
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]

    def script(history, turn):
        if turn == 0:
            return call("multiply", a=int(history.split("What is ")[-1].split(" ")[0]), b=7)
        return history.split("<tool_response>\n")[-1].split("\n")[0] + "<|im_end|>"

    module = GRPOModule(model, tokenizer=tok, rewards=[correct], rollout=ScriptedRollout(tok, script),
                        tools=[multiply], tool_format="hermes", num_generations=2, max_completion_length=96,
                        micro_batch_size=4)
    rows = fit(module, QUESTIONS, 1, tmp_path)
    metrics = rows[-1]
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["episodes/mean_turns"] == 2.0 and metrics["reward"] == 1.0
    roles = [[m["role"] for m in c] for c in seen["completions"]]
    assert roles == [["assistant", "tool", "assistant"]] * 4
    assert module.last_rollout.completions[0][1] == {"role": "tool", "name": "multiply", "content": "84"}


@pytest.mark.slow
def test_a_trl_environment_class_and_a_text_environment_train_on_the_engine(smollm2_folder, tmp_path):
    """The native engine samples for real here: whatever SmolLM2 does, the step runs and the environments'
    own rewards are logged under their class names."""
    model, tok = load_model(smollm2_folder)
    module = GRPOModule(model, tokenizer=tok, rewards=[], environment_factory=CounterEnv, tool_format="hermes",
                        num_generations=2, max_completion_length=24, micro_batch_size=4, temperature=1.0)
    metrics = fit(module, QUESTIONS, 1, tmp_path / "counter")[-1]
    assert "rewards/CounterEnv/mean" in metrics and "episodes/mean_turns" in metrics
    rows = [{"prompt": [{"role": "user", "content": "Guess a number from 1 to 4; answer with one number."}],
             "target": t} for t in (1, 3)]
    module = GRPOModule(model, tokenizer=tok, rewards=[], environment_factory={"name": "guess_number", "init_args":
                        {"low": 1, "high": 4, "max_guesses": 3}}, num_generations=2, max_completion_length=48,
                        micro_batch_size=4, tool_format="hermes")
    metrics = fit(module, rows, 1, tmp_path / "guess")[-1]
    assert 0.0 <= metrics["rewards/GuessNumber/mean"] <= 1.0 and metrics["episodes/mean_turns"] >= 1.0
