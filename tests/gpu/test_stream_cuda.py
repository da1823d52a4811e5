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
