"""The engine's stream (streaming GRPO's rollout): submissions draw what a rollout of each alone draws (a hybrid's
too, its recurrent-state slots recycled), runs stop between decode steps with nothing launched ahead, each token
records the weights' version, and closing frees the pool."""
import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.engine.stream import EngineStream
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import EOS, PROMPTS, tiny_hf_folder

SAMPLING = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[EOS])


@pytest.mark.parametrize("family,config,slots", [
    ("llama", dict(), None), ("llama", dict(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=16), None),
    # a hybrid with fewer state slots than the submissions' sequences: slots are recycled as sequences end
    ("qwen3_5_text", dict(max_num_seqs=4), 6)], ids=["roomy", "preempting", "hybrid-recycling-slots"])
def test_each_submission_draws_what_it_draws_alone(tmp_path, family, config, slots):
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    engine = LLMEngine(model, EngineConfig(**config))
    first, second = [p for p in PROMPTS for _ in range(2)], PROMPTS[::-1]
    alone = [engine.generate(first, SamplingParams(**{**vars(SAMPLING), "seed": 11})),
             engine.generate(second, SamplingParams(**{**vars(SAMPLING), "seed": 12}))]
    stream = EngineStream(engine, SAMPLING, max_sequences=slots or len(first) + len(second), max_prompt_tokens=8)
    a = stream.submit(first, seed=11)
    stream.run(lambda: engine._steps >= 4)  # a pause part-way; the second submission joins in flight
    engine.release()  # the pool goes back for training: the sequences in flight are recomputed after
    assert engine.runner is None and len(engine.scheduler.running) == 0 and engine.scheduler.waiting
    b = stream.submit(second, seed=12)
    stream.run(lambda: False)
    got = [[stream.pop(a + i).completion_token_ids for i in range(len(first))],
           [stream.pop(b + i).completion_token_ids for i in range(len(second))]]
    assert got == [alone[0].completion_ids, alone[1].completion_ids]
    if slots:
        assert len(first) + len(second) > slots and sorted(engine.scheduler.free_slots) == list(range(slots))
    bm = engine.scheduler.bm
    stream.close()
    assert bm.num_free == bm.num_blocks and engine.stream is None
    assert engine.generate(PROMPTS[:1], SAMPLING).completion_ids  # the engine generates again once closed


def test_a_pause_leaves_no_step_ahead_and_tokens_record_the_version_they_were_drawn_under(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    engine = LLMEngine(model, EngineConfig(lookahead=True))
    stream = EngineStream(engine, SamplingParams(max_tokens=30, temperature=1.0), max_sequences=4,
                          max_prompt_tokens=8)
    first = stream.submit(PROMPTS[:4], seed=1)
    drawn = []  # (version, weights' checksum) at each forward
    hook = model.register_forward_pre_hook(lambda m, a: drawn.append(
        (stream.version, sum(p.double().sum().item() for p in m.parameters()))))
    for version in range(1, 4):
        start = engine._steps
        stream.run(lambda: engine._steps >= start + 5)
        assert engine._ahead is None  # nothing was launched on the weights about to change
        with torch.no_grad():
            next(model.parameters()).add_(0.01)  # an "optimizer step" between two decode steps
        stream.version = version
    stream.run(lambda: False)
    hook.remove()
    by_version = {}
    for version, checksum in drawn:
        assert by_version.setdefault(version, checksum) == checksum  # one set of weights per version
    samples = [stream.pop(first + i).versions for i in range(4)]
    for versions in samples:
        assert versions == sorted(versions) and len(versions) == 30
    assert sorted(by_version) == [0, 1, 2, 3] and all(set(v) == {0, 1, 2, 3} for v in samples)
    stream.close()


def test_generate_while_a_stream_is_open_is_refused(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    engine = LLMEngine(model)
    stream = EngineStream(engine, SAMPLING, max_sequences=2, max_prompt_tokens=8)
    with pytest.raises(RuntimeError, match="close it before generate"):
        engine.generate(PROMPTS[:1], SAMPLING)
    stream.close()
