"""The README's Python example, run as written: 3 GRPO steps of SmolLM2 on CPU change its parameters."""
import re
import runpy
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_grpo_example_trains_smollm2(smollm2_folder):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    example = next(b for b in blocks if "trainer.fit" in b)
    scope: dict = {}
    exec(compile(example, str(README), "exec"), scope)
    module, trainer = scope["module"], scope["trainer"]
    assert trainer.global_step == 3
    from rlcu.models import load_model

    start, _ = load_model("smollm2-135m-instruct")
    changed = [n for (n, p), q in zip(module.policy.named_parameters(), start.parameters()) if not torch.equal(p, q)]
    assert len(changed) > 0.9 * len(list(start.parameters())), f"only {len(changed)} tensors changed"
    metrics = trainer.callback_metrics
    assert {"reward", "rewards/math_answer/mean", "completions/mean_length", "loss"} <= set(metrics)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.DOTALL)


@pytest.mark.slow
def test_getting_started_python_example_runs(smollm2_folder):
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "getting-started.md")[0], scope)
    assert scope["module"].global_step == 2


def test_reward_guide_class_example_scores():
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "write-a-reward.md")[1], scope)
    reward = scope["KeywordReward"](word="so")
    assert reward(["p", "p"], ["so 4", [{"role": "assistant", "content": "4"}]], [[1], [2]]) == [1.0, 0.0]
    assert reward.name == "keyword"


@pytest.mark.slow
def test_agents_guide_example_trains_with_a_tool(smollm2_folder):
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "agents.md")[0], scope)
    assert scope["trainer"].global_step == 1
    assert {"tools/call_frequency", "tools/failure_frequency", "episodes/mean_turns"} <= set(
        scope["trainer"].callback_metrics)


def test_models_guide_example_adds_a_family_and_matches_transformers():
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "models.md")[2], scope)
    assert scope["gap"] < 1e-5 and scope["tokenizer"] is None
    assert scope["ours"].model.layers[0].self_attn.window == 5


def test_models_guide_moe_example_matches_transformers():
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "models.md")[0], scope)
    assert scope["moe_gap"] < 1e-5 and scope["ours"].config.is_moe


def test_models_guide_hybrid_example_matches_transformers_and_the_training_forward():
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "models.md")[1], scope)
    assert scope["hybrid_gap"] < 1e-5 and scope["state_gap"] < 1e-4 and scope["ours"].config.linear_layers == [0, 1, 2]


def test_agents_guide_program_example_trains_one_step(tmp_path):
    from rlcu.models import load_model
    from tests.helpers import CHAT_TEMPLATE, fit, tiny_hf_folder, toy_rows

    pytest.importorskip("openai")
    model, tokenizer = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    scope: dict = {"model": model, "tokenizer": tokenizer}
    exec(python_blocks(README.parent / "docs" / "agents.md")[2], scope)
    metrics = fit(scope["module"], toy_rows(4), steps=1, log_dir=tmp_path)
    assert any("rewards/agent/mean" in m for m in metrics)


def test_agents_guide_branching_example_trains_each_branch_as_a_row(tmp_path, monkeypatch):
    from rlcu.grpo.module import GRPOModule
    from rlcu.grpo.score_phase import Scoring
    from rlcu.models import load_model
    from tests.helpers import CHAT_TEMPLATE, fit, tiny_hf_folder, toy_rows

    pytest.importorskip("openai")
    rows, score = [], Scoring.__call__
    monkeypatch.setattr(Scoring, "__call__", lambda self, *a: rows.append(score(self, *a)) or rows[-1])
    model, tokenizer = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    scope: dict = {"model": model, "tokenizer": tokenizer}
    exec(python_blocks(README.parent / "docs" / "agents.md")[7], scope)
    assert isinstance(scope["module"], GRPOModule)
    metrics = fit(scope["module"], toy_rows(2), steps=1, log_dir=tmp_path, batch_size=1)
    assert len(rows[0].batch) == 8 and any(m.get("episodes/mean_branches") == 1.0 for m in metrics)


def test_agents_guide_text_program_example_trains_one_step_on_a_model_without_a_chat_template(tmp_path):
    from rlcu.grpo.module import GRPOModule
    from rlcu.models import load_model
    from tests.helpers import fit, tiny_hf_folder

    pytest.importorskip("openai")
    model, tokenizer = load_model(tiny_hf_folder(tmp_path / "m", "qwen3"))
    scope: dict = {}
    exec(python_blocks(README.parent / "docs" / "agents.md")[4], scope)
    module = GRPOModule(model, tokenizer=tokenizer, agent=scope["continue_text"], num_generations=4,
                        max_completion_length=24)
    metrics = fit(module, [{"prompt": f"t{i} t{i + 1}", "answer": f"t{i + 2}"} for i in range(4)], steps=1,
                  log_dir=tmp_path)
    assert any(m.get("episodes/mean_calls") == 2.0 for m in metrics)


def test_agents_guide_smolagents_example_trains_one_step(tmp_path):
    from rlcu.grpo.module import GRPOModule
    from rlcu.models import load_model
    from tests.helpers import CHAT_TEMPLATE, fit, tiny_hf_folder

    pytest.importorskip("smolagents")
    model, tokenizer = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE,
                                                 max_position_embeddings=8192))
    example = tmp_path / "agent_example.py"  # smolagents reads a tool's source: the block runs from a file
    example.write_text(python_blocks(README.parent / "docs" / "agents.md")[3])
    scope = runpy.run_path(str(example))
    module = GRPOModule(model, tokenizer=tokenizer, agent=scope["solve"], agent_history="served",
                        tool_format="hermes", num_generations=2, max_completion_length=2000, max_call_tokens=8,
                        max_prompt_length=4000)
    metrics = fit(module, [{"prompt": "What is 6 x 7?", "answer": 42}] * 2, steps=1, log_dir=tmp_path, batch_size=2)
    assert any(m.get("episodes/mean_calls", 0) >= 2 for m in metrics)


def test_architecture_guide_examples_add_a_family_a_loss_and_a_backend():
    from rlcu.grpo import registry

    scope: dict = {}
    blocks = python_blocks(README.parent / "docs" / "architecture.md")
    assert len(blocks) == 3
    try:
        exec(blocks[0], scope)
        assert scope["family_gap"] < 1e-5
        exec(blocks[1], scope)
        assert registry.loss_type("reinforce").surrogate is scope["reinforce"]
        assert scope["module"].loss_kind.name == "reinforce" and float(scope["trainer"].callback_metrics["loss"]) != 0
        exec(blocks[2], scope)
        assert scope["backend"].requests == 8 and scope["trainer"].global_step == 1
        with pytest.raises(ValueError, match="'on_finished' capability .* CountingRollout does not declare it"):
            scope["GRPOModule"](scope["folder"], rewards=[scope["length"]], rollout=scope["CountingRollout"](),
                                score_during_generation=True)
    finally:
        registry.LOSSES.pop("reinforce", None)


@pytest.mark.slow
def test_streaming_guide_example_trains_two_steps(smollm2_folder):
    scope: dict = {}
    first, beside = python_blocks(README.parent / "docs" / "streaming.md")[:2]
    exec(first, scope)
    assert scope["trainer"].global_step == 2  # after the batch that filled the stream
    assert {"streaming/staleness_mean", "streaming/dropped_stale"} <= set(scope["trainer"].callback_metrics)
    exec(beside, scope)  # decoding beside training, on the same rows
    assert scope["trainer"].global_step == 2 and scope["module"].streamer.beside is None
    assert "streaming/decode_steps_beside" in scope["trainer"].callback_metrics
