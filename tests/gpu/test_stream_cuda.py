"""Streaming on the GPU: the engine's stream decodes through CUDA graphs across in-place weight changes and pool
releases (each version's tokens drawn under that version's weights, every block back at the end), a hybrid's too
(its recurrent-state slots recycled), and a streaming GRPO run trains on CUDA with bf16 weights."""
import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.engine.stream import EngineStream
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import PROMPTS, fit, match_target, tiny_hf_folder, toy_model, toy_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family,slots", [("llama", 64), ("qwen3_5_text", 24)])
def test_the_stream_runs_on_graphs_across_updates_and_releases(tmp_path, family, slots):
    if family == "qwen3_5_text":
        pytest.importorskip("fla", reason="the hybrids' CUDA path needs flash-linear-attention")
    model = load_model(tiny_hf_folder(tmp_path, family, vocab_size=512, hidden=256, heads=4, kv_heads=2,
                                      head_dim=64))[0].cuda().to(torch.bfloat16)
    engine = LLMEngine(model, EngineConfig(cuda_graphs=True))
    stream = EngineStream(engine, SamplingParams(max_tokens=48, temperature=1.0), max_sequences=slots,
                          max_prompt_tokens=16)
    first = stream.submit([p for p in PROMPTS for _ in range(8)], seed=3)
    drawn = []
    hook = model.register_forward_pre_hook(lambda m, a: drawn.append(stream.version))
    for version in range(1, 4):
        start = engine._steps
        stream.run(lambda: engine._steps >= start + 10)
        assert engine._ahead is None
        engine.release()  # as before training: the sequences in flight are recomputed when decoding resumes
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        stream.version = version
        stream.submit(PROMPTS[:2], seed=10 + version)
    stream.run(lambda: False)
    hook.remove()
    samples = [stream.pop(first + i).versions for i in range(len(PROMPTS) * 8)]
    assert all(v == sorted(v) and len(v) == 48 for v in samples) and {x for v in samples for x in v} == {0, 1, 2, 3}
    assert engine.runner.graphs, "decode steps did not run as CUDA graphs"
    bm = engine.scheduler.bm
    assert bm.num_free == bm.num_blocks
    stream.close()


def test_a_streaming_run_trains_on_cuda(tmp_path):
    from rlcu.grpo.module import GRPOModule

    model, tok = toy_model(tmp_path / "m")
    module = GRPOModule(model.cuda(), tokenizer=tok, rewards=[match_target], num_generations=4,
                        max_completion_length=16, stop=["t7", "t9"], micro_batch_size=8, learning_rate=1e-2,
                        streaming=True, max_staleness=2)
    metrics = [m for m in fit(module, toy_rows(40, seed=1), steps=4, log_dir=tmp_path, batch_size=2,
                              accelerator="gpu") if "reward" in m]
    assert len(metrics) == 4 and max(m["streaming/staleness_max"] for m in metrics) <= 2


@pytest.mark.parametrize(("precision", "priority"), [("32-true", 0), ("bf16-mixed", 0), ("bf16-mixed", -1)])
def test_decoding_beside_training_on_cuda_is_the_run_that_decodes_those_steps_first(tmp_path, monkeypatch, precision,
                                                                                     priority):
    """decode_steps_during_training on CUDA: the worker's decode steps (their own CUDA stream, at the engine's
    beside_priority, the graphs captured so far replayed, the autocast of the step) equal, to the bit, the same steps
    decoded first in the step's thread."""
    from rlcu.grpo.module import GRPOModule
    from rlcu.models import load_model
    from rlcu.rollout.native import NativeRollout
    from tests.grpo.test_streaming import DecodedFirst
    from tests.helpers import CHAT_TEMPLATE

    runs = []
    for beside in (True, False):
        if not beside:
            monkeypatch.setattr(EngineStream, "decode_beside", lambda self, steps: DecodedFirst(self, steps))
        # head_dim 64: the Triton kernels and CUDA graphs of the engine
        model, tok = load_model(tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=256, heads=4,
                                               kv_heads=2, head_dim=64, chat_template=CHAT_TEMPLATE))
        module = GRPOModule(model.cuda(), tokenizer=tok, rewards=[match_target], num_generations=4,
                            max_completion_length=16, stop=["t7", "t9"], micro_batch_size=8, learning_rate=1e-2,
                            streaming=True, max_staleness=2, decode_steps_during_training=6,
                            rollout=NativeRollout(EngineConfig(beside_priority=priority)))
        metrics = [m for m in fit(module, toy_rows(40, seed=1), steps=5, log_dir=tmp_path / str(beside),
                                  batch_size=2, accelerator="gpu", precision=precision) if "reward" in m]
        runs.append(({k: v.detach().cpu() for k, v in module.policy.state_dict().items()},
                     [(m["reward"], m.get("streaming/decode_steps_beside")) for m in metrics]))
    (threaded, threaded_metrics), (first, first_metrics) = runs
    assert threaded_metrics == first_metrics and all(torch.equal(threaded[k], first[k]) for k in first)
    assert any(n for _, n in threaded_metrics[1:])
