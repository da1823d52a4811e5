"""Agent programs in worker processes (`agent_processes`): the same episodes as on the trainer's thread, token for
token, rollout after rollout on the same workers; a program that raises, returns early, does not pickle or loses
its worker is one line naming it; a GRPO step trains with them and the workers stop at teardown."""
import os

import pytest
import torch

from rlcu.agents.formats import tool_format
from rlcu.agents.programs import ProgramRunner
from rlcu.agents.workers import ProgramWorkers
from rlcu.contracts import SamplingParams
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from tests.agents.test_programs import ROWS, run_episodes, three_calls
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

pytest.importorskip("openai")


@pytest.fixture
def tiny(tmp_path):
    return load_model(tiny_hf_folder(tmp_path, "qwen3", chat_template=CHAT_TEMPLATE))


@pytest.fixture
def workers():
    pool = ProgramWorkers(2)
    yield pool
    pool.close()


def runner(rows, program, tok, workers=None, timeout=60.0):
    return ProgramRunner(rows, program, tool_format("template", tok), "policy", 40, timeout, workers=workers)


async def quits(endpoint, row):
    return 0.0


async def raises(endpoint, row):
    await endpoint.client().chat.completions.create(model="policy", messages=[{"role": "user", "content": "t1"}])
    raise KeyError("boom")


async def exits(endpoint, row):
    """Its worker process dies between the episode's calls."""
    await endpoint.client().chat.completions.create(model="policy", messages=[{"role": "user", "content": "t1"}])
    os._exit(3)


def one_at_a_time(model, runner):
    """The runner's episodes one sequence a step, so that their tokens and logprobs do not depend on which calls
    share a step (the calls come at other times from other processes); then their record, the runner closed."""
    try:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=1))
        sp = SamplingParams(max_tokens=40, max_turn_tokens=5, temperature=1.0, seed=0)
        return engine.generate(runner.prompt_ids, sp, continuation=runner), runner.record()
    finally:
        runner.close()


def test_episodes_in_worker_processes_equal_those_on_the_trainers_thread(tiny, workers):
    model, tok = tiny
    rows = ROWS * 3  # six episodes over two workers
    out, episodes = one_at_a_time(model, runner(rows, three_calls, tok))
    for _ in range(2):  # the same workers serve a second rollout
        there = runner(rows, three_calls, tok, workers)
        out_w, episodes_w = one_at_a_time(model, there)
        assert episodes_w.columns["agent_returns"] == episodes.columns["agent_returns"] == [1.0, 2.0] * 3
        assert out_w.completion_ids == out.completion_ids and out_w.tool_mask == out.tool_mask
        assert list(episodes_w.completions) == list(episodes.completions)
        assert out_w.logprobs == out.logprobs
        assert not there.endpoint.loop, "the endpoint is left running"
    assert all(p.is_alive() for p in workers._procs), "the workers stop with a rollout"


def test_a_program_in_a_worker_that_fails_is_one_line_naming_the_episode(tiny, workers):
    model, tok = tiny
    with pytest.raises(RuntimeError, match=r"quits returned before its first call in episode 0"):
        runner([{"prompt": "x"}], quits, tok, workers)
    with pytest.raises(RuntimeError, match=r"raises raised in episode 0 .*KeyError: 'boom'"):
        run_episodes(model, runner([{"prompt": "x"}] * 2, raises, tok, workers), max_turn_tokens=4)

    async def closure(endpoint, row):
        return 1.0

    with pytest.raises(ValueError, match=r"closure does not pickle .* set agent_processes: 0"):
        runner([{"prompt": "x"}], closure, tok, workers)
    with pytest.raises(ValueError, match=r"a row does not pickle .* set agent_processes: 0"):
        runner([{"prompt": "x", "f": lambda: 0}], quits, tok, workers)


def test_a_lost_worker_ends_its_episodes_with_an_error_and_the_next_rollout_starts_anew(tiny, workers):
    model, tok = tiny
    with pytest.raises(RuntimeError, match=r"exits raised in episode 0 .*agent worker process exited \(code 3\)"):
        run_episodes(model, runner([{"prompt": "x"}], exits, tok, workers), max_turn_tokens=4)
    out, episodes = run_episodes(model, runner(ROWS, three_calls, tok, workers), max_turn_tokens=5)
    assert episodes.columns["agent_returns"] == [1.0, 2.0]


def test_a_grpo_step_trains_an_agent_program_in_a_worker_process(tmp_path):
    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", chat_template=CHAT_TEMPLATE))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target", num_generations=4,
                        max_completion_length=16, max_call_tokens=5, learning_rate=1e-2, micro_batch_size=8,
                        agent_processes=1)
    metrics = fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    assert any(m.get("episodes/mean_calls") == 2.0 for m in metrics)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert module.program_workers is None, "the workers outlive the fit"
