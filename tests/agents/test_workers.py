"""Agent programs in worker processes (`agent_processes`): the same episodes as on the trainer's thread, token for
token, rollout after rollout on the same workers; a program that raises, returns early, does not pickle or loses
its worker is one line naming it; a GRPO step trains with them and the workers stop at teardown. The endpoint's
HTTP side in a process of its own answers bad requests as the one in a thread does, rollout after rollout. The
default (-1) picks processes under the rlcu command for a program that pickles, a thread otherwise."""
import asyncio
import concurrent.futures
import json
import os
import sys
import time
import types
import urllib.error
import urllib.request

import pytest
import torch

from rlcu.agents.endpoint import EndpointProcess, HTTPError
from rlcu.agents.formats import tool_format
from rlcu.agents.programs import ProgramRunner
from rlcu.agents.workers import AUTO, ProgramWorkers, resolve_processes, started_from_cli
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
    share a step (the calls come at other times from other processes), in a pool roomy enough that no parked
    episode gives its blocks back (one that did would prefill its whole history again on its next turn: other
    shapes, other last bits, at a time set by when the replies came); then their record and the tokens prefilled,
    the runner closed."""
    try:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=1, num_blocks=64))
        sp = SamplingParams(max_tokens=40, max_turn_tokens=5, temperature=1.0, seed=0)
        out = engine.generate(runner.prompt_ids, sp, continuation=runner)
        assert engine.stats["preemptions"] == 0
        return out, runner.record(), engine.stats["prefill_tokens"]
    finally:
        runner.close()


def test_episodes_in_worker_processes_equal_those_on_the_trainers_thread(tiny, workers):
    model, tok = tiny
    rows = ROWS * 3  # six episodes over two workers
    out, episodes, prefilled = one_at_a_time(model, runner(rows, three_calls, tok))
    for _ in range(2):  # the same workers serve a second rollout
        there = runner(rows, three_calls, tok, workers)
        out_w, episodes_w, prefilled_w = one_at_a_time(model, there)
        assert prefilled_w == prefilled  # each turn prefilled once: no history computed again
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
    here = types.ModuleType("rlcu_test_only_here")  # pickles by name here; a fresh process cannot import it
    exec("async def agent(endpoint, row):\n    return 1.0", here.__dict__)
    sys.modules[here.__name__] = here
    try:
        with pytest.raises(RuntimeError, match=r"agent worker process cannot load the program .* import path"):
            runner([{"prompt": "x"}], here.agent, tok, workers)
    finally:
        del sys.modules[here.__name__]


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
    with pytest.raises(ValueError, match="agent_processes runs agent programs .* drop agent_processes"):
        GRPOModule(model, tokenizer=tok, tools=[len], agent_processes=2)


class Stub:
    """A handler: episode "e1" answers at once (a 409 for a body asking it), "slow" never answers."""

    model_name = "policy"

    def has_episode(self, episode: str) -> bool:
        return episode in ("e1", "slow")

    async def chat(self, episode: str, body: dict) -> dict:
        if episode == "slow":
            await asyncio.Event().wait()
        if body.get("branch"):
            raise HTTPError(409, "a branch", "episode_branch")
        if body.get("boom"):
            raise KeyError("boom")
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "policy",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "t5 t6"},
                             "finish_reason": "stop", "logprobs": None}]}

    async def completion(self, episode: str, body: dict) -> dict:
        raise HTTPError(400, "no text here")


def test_the_endpoints_process_answers_bad_requests_and_between_rollouts_and_closes_its_port():
    from tests.agents.test_programs import _post

    front = EndpointProcess()
    try:
        served = front.serve(Stub())
        served.start()
        url, key = served.base_url("e1") + "/chat/completions", served.api_key
        good = json.dumps({"messages": [{"role": "user", "content": "t1"}]}).encode()
        statuses = {name: _post(url, body, k)[0] for name, body, k in [
            ("wrong key", good, "rlcu-wrong"), ("no key", good, None), ("malformed", b"{not json", key),
            ("10 MB", b'{"x": "' + b"a" * (10 << 20) + b'"}', key), ("branch", b'{"branch": 1}', key),
            ("raises", b'{"boom": 1}', key), ("text", b'{"prompt": "x"}', key)]}
        statuses["text"] = _post(served.base_url("e1") + "/completions", b'{"prompt": "x"}', key)[0]
        statuses["unknown episode"] = _post(served.base_url("e2") + "/chat/completions", good, key)[0]
        status, out = _post(url, good, key)
        assert statuses == {"wrong key": 401, "no key": 401, "malformed": 400, "10 MB": 413, "branch": 409,
                            "raises": 500, "text": 400, "unknown episode": 404}
        assert status == 200 and out["choices"][0]["message"]["content"] == "t5 t6"
        stream = json.dumps({"messages": [{"role": "user", "content": "t1"}], "stream": True}).encode()
        request = urllib.request.Request(url, stream, {"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.read().decode().endswith("data: [DONE]\n\n")
        slow = concurrent.futures.ThreadPoolExecutor(1).submit(_post, served.base_url("slow") + "/chat/completions",
                                                                good, key)
        time.sleep(0.5)
        served.stop()  # the rollout ends: its unanswered call gets 404, its key no longer opens anything
        assert slow.result(30)[0] == 404
        assert _post(url, good, key)[0] == 401
        again = front.serve(Stub())  # the next rollout, on the same port
        again.start()
        assert again.port == served.port and _post(url, good, again.api_key)[0] == 200
        again.stop()
    finally:
        front.close()
    with pytest.raises(urllib.error.URLError):
        _post(url, good, key)


def test_the_default_picks_processes_under_the_rlcu_command_for_a_program_that_pickles(tmp_path, monkeypatch, caplog):
    from rlcu.grpo.module import GRPOModule

    async def closure(endpoint, row):
        return 1.0

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert resolve_processes(0, three_calls) == 0 and resolve_processes(3, closure) == 3  # given: as given
    assert resolve_processes(AUTO, three_calls) == 0  # from Python: a script may not be guarded
    with started_from_cli():
        assert resolve_processes(AUTO, three_calls) == 4
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        assert resolve_processes(AUTO, three_calls) == 1
        with caplog.at_level("INFO", logger="rlcu.agents.workers"):
            assert resolve_processes(AUTO, closure) == 0
        assert "runs test_the_default_picks_processes_under_the_rlcu_command_for_a_program_that_pickles.<locals>." \
               "closure on a thread of this process: it does not pickle" in caplog.text
        model, tok = load_model(tiny_hf_folder(tmp_path, "qwen3", chat_template=CHAT_TEMPLATE))
        module = GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target")
        assert module.program[2] == 1
        assert GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target",
                          agent_processes=0).program[2] == 0
    assert resolve_processes(AUTO, three_calls) == 0, "the rlcu command's mark outlives it"
    assert GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target").program[2] == 0
    with pytest.raises(ValueError, match=r"agent_processes must be >= -1 \(-1: auto\), got -2"):
        GRPOModule(model, tokenizer=tok, agent="tests.agents.test_programs:echo_target", agent_processes=-2)
