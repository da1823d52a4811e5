"""A verifiers environment (verifiers 0.4, built with its own classes: docs/agents.md's example module) trains a GRPO
step through the endpoint: its harness's two calls become one sample, and its task's @vf.reward is the reward."""
import pytest

from rlcu.models import load_model
from tests.helpers import CHAT_TEMPLATE, fit, tiny_hf_folder

pytest.importorskip("verifiers.v1", reason="verifiers==0.4.0 (the test extra) runs this test")


@pytest.fixture
def example(tmp_path, monkeypatch):
    """docs/agents.md's verifiers example: the environment module written as `my_arith.py` on the path, and the
    usage block's namespace (`env`, `rows`, `module`) on a tiny model."""
    from tests.integration.test_readme_example import README, python_blocks

    blocks = python_blocks(README.parent / "docs" / "agents.md")
    (tmp_path / "my_arith.py").write_text(blocks[5])
    monkeypatch.syspath_prepend(str(tmp_path))
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    scope = {"model": model, "tokenizer": tok}
    exec(blocks[6], scope)
    return scope


def test_the_agents_guide_verifiers_example_trains_a_grpo_step(example, tmp_path):
    env, module = example["env"], example["module"]
    assert [r["vf_task"] for r in example["rows"]] == list(range(8))
    assert example["rows"][3]["prompt"] == "What is 3 + 3?"
    metrics = fit(module, example["rows"][:2], steps=1, log_dir=tmp_path, batch_size=2)
    trained = [m for m in metrics if m.get("rewards/agent/mean") not in (None, "")]
    assert trained and float(trained[0]["episodes/mean_calls"]) == 2.0  # the harness's two calls, one sample
    # the reward's agreement with the task's rubric, episode by episode, is the next test's
    assert 0.0 <= float(trained[0]["rewards/agent/mean"]) <= 1.0 and trained[0]["loss"] not in (None, "")
    assert not env._serving, "the environment's serving resources are left held"


def test_the_verifiers_reward_is_the_tasks_rubric_on_the_served_turns(example):
    """One episode through the endpoint, with the task's reward checked against the served answer."""
    from rlcu.agents.formats import tool_format
    from rlcu.agents.programs import ProgramRunner
    from rlcu.contracts import SamplingParams
    from rlcu.engine.llm_engine import EngineConfig, LLMEngine

    env, model, tok = example["env"], example["model"], example["tokenizer"]
    rows = example["rows"][:2]
    runner = ProgramRunner(rows, env, tool_format("template", tok), "policy", 24, 60.0)
    try:
        LLMEngine(model, EngineConfig(max_num_seqs=4)).generate(
            runner.prompt_ids, SamplingParams(max_tokens=24, max_turn_tokens=8, temperature=1.0, seed=0),
            continuation=runner)
        episodes = runner.record()
    finally:
        runner.close()
    for row, messages, reward in zip(rows, episodes.completions, episodes.columns["agent_returns"]):
        assert [m["role"] for m in messages] == ["assistant", "user", "assistant"]
        answer = str(2 * row["vf_task"])
        assert reward == float(answer in messages[-1]["content"])


def test_a_row_without_a_task_is_one_clear_error(example):
    import asyncio

    from rlcu.agents.programs import AgentEndpoint

    with pytest.raises(ValueError, match="give the data module VerifiersEnvironment.rows"):
        asyncio.run(example["env"](AgentEndpoint("http://127.0.0.1:1/v1", "k", "policy"), {"prompt": "x"}))


def test_a_verifiers_environment_trains_from_a_yaml_config(example, tmp_path, monkeypatch):
    """`rlcu run CONFIG`: the agent as LightningCLI writes a class (class_path, init_args), the rows from the
    taskset_rows data source."""
    import csv

    from rlcu import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = tmp_path / "vf.yaml"
    config.write_text(f"""
trainer:
  max_steps: 1
  accelerator: cpu
  precision: 32-true
  enable_checkpointing: false
  enable_progress_bar: false
  log_every_n_steps: 1
  logger: [{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: runs, name: vf}}}}]
model:
  model: {tmp_path / "m"}
  agent: {{class_path: rlcu.agents.verifiers.VerifiersEnvironment, init_args: {{env: my_arith}}}}
  num_generations: 2
  max_completion_length: 24
  max_call_tokens: 8
  micro_batch_size: 4
  max_prompt_length: 64
data:
  dataset: rlcu.agents.verifiers:taskset_rows
  dataset_args: {{env: my_arith}}
  batch_size: 2
""")
    cli.main(["run", str(config)])
    rows = list(csv.DictReader(open(next(tmp_path.glob("runs/vf/version_*/metrics.csv")))))
    assert any(r.get("rewards/agent/mean") not in (None, "") and r.get("episodes/mean_calls") == "2.0" for r in rows)


def test_a_wrong_agent_class_is_one_clear_error():
    from rlcu.agents.programs import load_program

    with pytest.raises(ValueError, match="agent class 'rlcu.agents.verifiers.NoSuch' cannot be imported"):
        load_program({"class_path": "rlcu.agents.verifiers.NoSuch"})
    with pytest.raises(ValueError, match="give {'class_path'"):
        load_program({"class_path": "VerifiersEnvironment", "args": {}})
