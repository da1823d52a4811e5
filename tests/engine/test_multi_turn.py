"""Multi-turn episodes in the engine: a scripted continuation appends tokens after each turn. The engine
keeps each episode's KV between turns and prefills only what was appended; its greedy episodes equal the
turn-by-turn loop over the reference backend; no block leaks, under memory pressure too; a slow reply does
not hold up the other episodes; the sampled tokens' logprobs equal a fresh forward over the episode; requests a
continuation adds as the rollout runs (`Spawns`) run as episodes of their own."""
import threading
import time

import pytest
import torch

from rlcu.contracts import Reply, RolloutEnded, SamplingParams, Spawns, Turn
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from rlcu.rollout.reference import ReferenceRollout
from rlcu.rollout.turns import generate, generate_in_turns
from tests.helpers import EOS, PROMPTS, tiny_hf_folder

TURNS = 3


class Scripted:
    """Appends [30 + request, 31, 32] after each of the first TURNS - 1 turns, then ends the episode."""

    def __init__(self):
        self.turns: dict[int, list[Turn]] = {}
        self.lock = threading.Lock()

    def __call__(self, turn: Turn) -> Reply:
        with self.lock:
            seen = self.turns.setdefault(turn.request, [])
            seen.append(turn)
        if len(seen) == TURNS:
            return Reply(None)
        return Reply([30 + turn.request % 8, 31, 32])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(tiny_hf_folder(tmp_path_factory.mktemp("m"), "qwen3"))[0]


def sampling(**kw):
    return SamplingParams(**{"max_tokens": 40, "max_turn_tokens": 6, "temperature": 0, "stop_token_ids": [EOS]} | kw)


def reference_episodes(model, prompts, sp, continuation):
    backend = ReferenceRollout()
    backend.model = model
    return generate_in_turns(backend.generate, prompts, sp, continuation)


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(num_blocks=10, max_num_seqs=4,
                                                                 max_num_batched_tokens=16)],
                         ids=["roomy", "tight-pool"])
def test_greedy_episodes_equal_the_turn_by_turn_reference(model, config):
    prompts = PROMPTS + [PROMPTS[0]] * 3  # forks share the prompt's blocks across turns
    engine = LLMEngine(model, config)
    got = engine.generate(prompts, sampling(), Scripted())
    want = reference_episodes(model, prompts, sampling(), Scripted())
    assert got.completion_ids == want.completion_ids
    assert got.tool_mask == want.tool_mask and got.finish_reasons == want.finish_reasons
    for ids, mask in zip(got.completion_ids, got.tool_mask):
        appended = [t for t, m in zip(ids, mask) if m == 0]
        assert len(appended) == 3 * (TURNS - 1) and appended[1:3] == [31, 32]
    if config.num_blocks == 10:
        assert engine.stats["preemptions"] > 0  # idle episodes gave their blocks back and were recomputed
    # generate() raises on a leaked block; here it returned


def test_later_turns_prefill_only_the_appended_tokens(model):
    prompts = PROMPTS[:3]
    engine = LLMEngine(model)
    out = engine.generate(prompts, sampling(), Scripted())
    resumes = sum(1 for mask in out.tool_mask for j, m in enumerate(mask) if m == 0 and (j == 0 or mask[j - 1] == 1))
    # each resume computes the token sampled last (not yet in the cache) and the appended ones
    expected = sum(len(p) for p in prompts) + resumes * (1 + 3)
    assert engine.stats["prefill_tokens"] == expected
    assert resumes == len(prompts) * (TURNS - 1)


def test_a_slow_reply_does_not_hold_up_other_episodes(model):
    others_done = threading.Event()
    finished = set()

    def reply(turn: Turn) -> Reply:
        if turn.request == 0:  # waits until every other episode has ended: a blocking engine would time out
            assert others_done.wait(timeout=60), "the engine waited on episode 0 before decoding the others"
            return Reply(None)
        finished.add(turn.request)
        if len(finished) == len(PROMPTS) - 1:
            others_done.set()
        return Reply(None)

    out = LLMEngine(model).generate(PROMPTS, sampling(), reply)
    assert len(out) == len(PROMPTS)


def test_sampled_logprobs_equal_a_fresh_forward_over_the_episode(model):
    sp = sampling(temperature=0.8, seed=5)
    out = LLMEngine(model).generate(PROMPTS, sp, Scripted())
    for p, c, lp, mask in zip(out.prompt_ids, out.completion_ids, out.logprobs, out.tool_mask):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), sp.temperature)
        sampled = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(lp)[sampled], ref[0][sampled], atol=1e-5, rtol=0)
        assert (torch.tensor(lp)[~sampled] == 0).all()


def test_replies_that_overflow_or_are_not_replies_are_errors(model):
    with pytest.raises(ValueError, match="leaves no room to sample"):
        LLMEngine(model).generate(PROMPTS[:1], sampling(max_tokens=8), lambda turn: Reply([5] * 10))
    with pytest.raises(TypeError, match="must return a Reply"):
        LLMEngine(model).generate(PROMPTS[:1], sampling(), lambda turn: [5])

    def broken(turn):
        raise RuntimeError("tool broke")

    with pytest.raises(RuntimeError, match="tool broke"):
        LLMEngine(model).generate(PROMPTS[:2], sampling(), broken)


def test_the_episode_end_reason_is_the_replys(model):
    out = LLMEngine(model).generate(PROMPTS[:2], sampling(), lambda turn: Reply(None, "length"))
    assert out.finish_reasons == ["length", "length"] and out.tool_mask == [[1] * len(c) for c in out.completion_ids]



class Spawning(Scripted):
    """Scripted episodes; each of the rollout's own requests adds one request (its prompt reversed) when its first
    turn ends, a request that runs as an episode of its own."""

    def __init__(self, prompts, capacity=None):
        super().__init__()
        self.prompts = prompts
        self.spawns = Spawns(len(prompts), len(prompts) if capacity is None else capacity, 64)
        self.added: dict[int, list[int]] = {}

    def __call__(self, turn: Turn) -> Reply:
        if turn.request < len(self.prompts) and turn.request not in self.turns:
            prompt = self.prompts[turn.request][::-1] + [9]
            self.added[self.spawns.add(prompt, 4)] = prompt
        return super().__call__(turn)


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(num_blocks=10, max_num_seqs=4,
                                                                 max_num_batched_tokens=16)],
                         ids=["roomy", "tight-pool"])
def test_requests_added_while_the_rollout_runs_are_episodes_of_their_own(model, config):
    prompts = PROMPTS[:5]
    spawning = Spawning(prompts)
    out = LLMEngine(model, config).generate(prompts, sampling(), spawning)
    assert len(out) == 2 * len(prompts) and sorted(spawning.added) == list(range(5, 10))
    assert out.prompt_ids[5:] == [spawning.added[i] for i in range(5, 10)]
    # each added request runs as it would have had it been one of the rollout's prompts, its first turn bounded by
    # its own 4 tokens
    alone = LLMEngine(model).generate(out.prompt_ids, sampling(first_turn_tokens=[None] * 5 + [4] * 5), Scripted())
    assert out.completion_ids == alone.completion_ids and out.tool_mask == alone.tool_mask
    assert [sum(m[:5]) for m in out.tool_mask[5:]] == [4] * 5
    with pytest.raises(RolloutEnded):  # the rollout's intake closed with it
        spawning.spawns.add([5])


def test_a_request_added_while_the_engine_waits_wakes_it(model):
    """Request 1's reply waits a second; request 0's continuation adds a request from a thread of its own 0.2 s in:
    the engine, with nothing else to compute, runs it before request 1's reply comes."""
    spawns = Spawns(2, 1, 8)
    ended: dict[int, float] = {}

    def reply(turn: Turn) -> Reply:
        ended.setdefault(turn.request, time.monotonic())
        if turn.request == 0:
            threading.Timer(0.2, spawns.add, ([7, 7, 7],)).start()
        if turn.request == 1:
            time.sleep(1.0)
            ended["reply 1"] = time.monotonic()
        return Reply(None)

    reply.spawns = spawns
    engine = LLMEngine(model)
    out = engine.generate(PROMPTS[:2], sampling(), reply)
    assert len(out) == 3 and out.prompt_ids[2] == [7, 7, 7]
    assert ended[2] < ended["reply 1"]
    # the engine waited, with nothing to compute, for most of reply 1's second; a reply came 1/3 s late on average
    assert 0.5 < engine.stats["waiting_s"] < 1.5 and engine.stats["mean_reply_ms"] > 300
    # a reply was pending through reply 1's second, the others' spans inside it
    assert 1.0 <= engine.stats["replies_pending_s"] < 1.5


def test_the_time_with_a_reply_pending_counts_overlapping_turns_once():
    from rlcu.engine.llm_engine import covered

    assert covered([]) == 0.0
    assert covered([(2.0, 3.0), (0.0, 1.0), (0.5, 1.5), (1.2, 1.4)]) == 2.5


def test_spawned_requests_are_numbered_after_the_prompts_and_taken_by_backends_that_say_so(model):
    def reply(turn):
        return Reply(None)

    reply.spawns = Spawns(3, 1, 8)
    with pytest.raises(ValueError, match="numbered from 3, not after the rollout's 2 prompts"):
        LLMEngine(model).generate(PROMPTS[:2], sampling(), reply)
    reply.spawns = Spawns(2, 1, 8)
    backend = ReferenceRollout()
    backend.model = model
    with pytest.raises(ValueError, match="ReferenceRollout does not take"):
        generate(backend, PROMPTS[:2], sampling(), reply)
    with pytest.raises(ValueError, match="1 to 8 prompt tokens"):
        reply.spawns.add([1] * 9)
    reply.spawns.add([1])
    with pytest.raises(ValueError, match="at most 1 spawned"):
        reply.spawns.add([1])


def test_continuation_threads_are_kept_between_rollouts_and_dropped_after_a_failure(model):
    """Agent programs' turns each wait in a thread: the engine keeps its threads from one rollout to the next (a
    rollout that started them anew held up its decode loop), and gives them up when a continuation failed (it may
    still hold one)."""
    threads = []

    def reply(turn: Turn) -> Reply:
        threads.append(threading.current_thread())
        return Reply(None)

    reply.waiting_turns = 20
    engine = LLMEngine(model)
    engine.generate(PROMPTS[:4], sampling(), reply)
    pool, first, threads[:] = engine._turns[0], set(threads), []
    engine.generate(PROMPTS[:4], sampling(), reply)
    # the same pool, its first threads still alive; it may have started more (a pool adds one when none is idle)
    assert engine._turns[0] is pool and engine._turns[1] == 20
    assert all(t.is_alive() for t in first) and set(threads) <= set(pool._threads)

    def broken(turn):
        raise RuntimeError("tool broke")

    broken.waiting_turns = 20
    with pytest.raises(RuntimeError, match="tool broke"):
        engine.generate(PROMPTS[:2], sampling(), broken)
    assert engine._turns is None
    engine.generate(PROMPTS[:4], sampling(), reply)
    assert engine._turns[0] is not pool and not set(threads[-4:]) & set(pool._threads)


def test_a_continuation_that_replies_later_answers_by_future_and_holds_no_thread(model):
    """`replies_later`: the call returns a Future at once, resolved from elsewhere (an agent program's next call);
    the episodes equal those of the same replies given at once, turn by turn on the reference backend too."""
    from concurrent.futures import Future

    class Later(Scripted):
        replies_later = True

        def __init__(self):
            super().__init__()
            self.callers = set()

        def __call__(self, turn: Turn) -> Future:
            self.callers.add(threading.current_thread())
            reply = Future()
            threading.Timer(0.01, lambda: reply.set_result(Scripted.__call__(self, turn))).start()
            return reply

    later = Later()
    got = LLMEngine(model).generate(PROMPTS[:4], sampling(), later)
    assert later.callers == {threading.current_thread()}  # called on the decode loop, which no reply held up
    want = LLMEngine(model).generate(PROMPTS[:4], sampling(), Scripted())
    assert got.completion_ids == want.completion_ids and got.tool_mask == want.tool_mask
    assert reference_episodes(model, PROMPTS[:4], sampling(), Later()).completion_ids == want.completion_ids

    def wrong(turn):
        return Reply(None)

    wrong.replies_later = True
    with pytest.raises(TypeError, match="replies later, so it must return a concurrent.futures.Future of its Reply"):
        LLMEngine(model).generate(PROMPTS[:1], sampling(), wrong)
