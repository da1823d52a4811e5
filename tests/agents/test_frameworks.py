"""An agent written with a real agent framework, smolagents' `ToolCallingAgent` over its `OpenAIServerModel`,
trains unchanged apart from its base URL. smolagents writes the served tool calls back as text and the tool
results as user messages, so its episodes need `agent_history: served`."""
import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from rlcu.agents.formats import tool_format
from rlcu.agents.programs import ProgramRunner
from rlcu.contracts import SamplingParams
from rlcu.models import load_model
from tests.agents.scripted import ScriptedRollout, call
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

smolagents = pytest.importorskip("smolagents")
tool = smolagents.tool


@tool
def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def smolagent(endpoint, row):
    """What a smolagents user writes, pointed at the episode's endpoint; rewarded when the answer is the row's."""
    model = smolagents.OpenAIServerModel(model_id=endpoint.model, api_base=endpoint.base_url,
                                         api_key=endpoint.api_key)
    agent = smolagents.ToolCallingAgent(tools=[multiply], model=model, max_steps=2, verbosity_level=0)
    answer = await asyncio.to_thread(agent.run, row["prompt"])
    return float(str(answer).strip() == str(row["answer"]))


def scripted_episode(tok, history: str):
    """SmolLM2's tokenizer and chat template (hermes tools) and a model that calls multiply, then final_answer."""
    script = lambda text, turn: call("multiply", a=6, b=7) if turn == 0 else call("final_answer", answer="42")  # noqa
    runner = ProgramRunner([{"prompt": "What is 6 x 7?", "answer": 42}], smolagent, tool_format("hermes", tok),
                           "policy", 4000, 60.0, history=history)
    try:
        out = ScriptedRollout(tok, script).generate(runner.prompt_ids, SamplingParams(max_tokens=4000),
                                                     continuation=runner)
        return out, runner.record()
    finally:
        runner.close()


def test_a_smolagents_tool_calling_agent_is_one_sample_of_its_served_turns(smollm2_folder):
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    out, episodes = scripted_episode(tok, "served")
    assert episodes.columns["agent_returns"] == [1.0]
    messages = episodes.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "user", "assistant"]
    assert messages[0]["tool_calls"][0]["function"]["name"] == "multiply"  # as served, not as smolagents rewrote it
    assert messages[1]["content"].startswith("Observation:") and "42" in messages[1]["content"]
    sampled = [t for t, m in zip(out.completion_ids[0], out.tool_mask[0]) if m]
    assert tok.decode(sampled) == call("multiply", a=6, b=7) + call("final_answer", answer="42")
    with pytest.raises(RuntimeError, match="needs agent_history: served"):
        scripted_episode(tok, "exact")


async def smolagent_scored_by_rewards(endpoint, row):
    await smolagent(endpoint, row)
    return None  # the run's rewards score the episode


def test_a_grpo_step_trains_a_smolagents_agent(tmp_path):
    """A random tiny model calls no tool: smolagents asks again, then for a final answer; the step trains on the
    episodes' tokens (scored by a reward that varies between samples, as a random model earns no answer)."""
    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, varied_reward

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE,
                                           max_position_embeddings=8192))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = GRPOModule(model, tokenizer=tok, agent=smolagent_scored_by_rewards, agent_history="served",
                        rewards=[varied_reward], num_generations=2,
                        max_completion_length=2000, max_call_tokens=8, learning_rate=1e-2, micro_batch_size=8,
                        tool_format="hermes", max_prompt_length=4000)
    metrics = fit(module, [{"prompt": "t3 t4", "answer": 12}] * 2, steps=1, log_dir=tmp_path, batch_size=2)
    assert any("rewards/varied_reward/mean" in m for m in metrics)
    assert any(m.get("episodes/mean_calls", 0) >= 2 for m in metrics)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
