"""The KV pool is sized by what can be held at once (shared prompt blocks counted once, at most
max_num_seqs running sequences) and by a memory budget; generation is the same whatever the size."""
import pytest

import rlcu.engine.pool as pool
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.engine.sequence import Sequence
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import tiny_hf_folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(tiny_hf_folder(tmp_path_factory.mktemp("pool")))[0].eval()


def family(prompt_len: int, max_tokens: int, samples: int) -> Sequence:
    seq = Sequence(list(range(1, prompt_len + 1)), prompt_len, max_tokens, frozenset(), request_index=0)
    seq.pending_forks = samples - 1
    return seq


def test_shared_prompt_blocks_count_once():
    # 40-token prompt: 2 full blocks shared by 4 samples; each sample's longest is 3 blocks (40 + 5 tokens)
    assert pool.blocks_all_at_once([family(40, 5, 4)], 16) == 2 + 4 * 1
    assert pool.blocks_all_at_once([family(8, 8, 3), family(16, 1, 1)], 16) == (0 + 3 * 1) + (1 + 1 * 1)


def test_many_requests_hold_no_more_than_what_runs_at_once(model):
    """300 samples of one prompt, 8 at a time: the pool holds 9 sequences' worth, not 300 (the CPU had no
    cap at all before: `rlcu generate --n 8000 --max_tokens 1` was killed for memory on 24 GB)."""
    prompts, sp = [[3, 4, 5]] * 300, SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    bounded = LLMEngine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))
    got = bounded.generate(prompts, sp)
    assert bounded.stats["num_blocks"] <= (8 + 1) * 1  # longest: 5 tokens, one block of 16
    assert bounded.stats["preemptions"] == 0  # the bound never makes the scheduler preempt
    roomy = LLMEngine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=700))
    roomy = roomy.generate(prompts, sp)
    assert got.completion_ids == roomy.completion_ids and got.logprobs == roomy.logprobs


def test_a_memory_budget_caps_the_pool_and_the_scheduler_preempts(model, monkeypatch):
    prompts = [list(range(1, 20))] * 4 + [list(range(2, 30))] * 4
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=2)
    want = LLMEngine(model).generate(prompts, sp)
    per_block = pool.bytes_per_block(model, 16)
    monkeypatch.setattr(pool, "available_memory", lambda device: 2 * 6 * per_block)  # half of it: 6 blocks
    engine = LLMEngine(model)
    got = engine.generate(prompts, sp)
    assert engine.stats["num_blocks"] == 6 and engine.stats["preemptions"] > 0
    assert got.completion_ids == want.completion_ids
