"""kv_cache_dtype: fp8 keys and values (e4m3), through the reference path and the Triton kernels under the
interpreter, on a tiny Qwen3 and on the real SmolLM2; its pool, its errors, and its logprob cost measured
against the training forward."""
from pathlib import Path

import pytest
import torch
import yaml

from rlcu.contracts import Numerics
from rlcu.engine import pool
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.kernels._triton import HAS_TRITON
from rlcu.kernels.kv_cache import FP8
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from rlcu.rollout.native import NativeRollout
from tests.helpers import EOS, PROMPTS, logprob_gaps, tiny_hf_folder


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
def test_fp8_triton_kernels_equal_the_reference_path(tmp_path, monkeypatch):
    """The same FP8 cache written and read by the Triton kernels (interpreter) and by the PyTorch references:
    the same greedy tokens; logprobs within fp32 summation order."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=64, heads=6, kv_heads=2, head_dim=64))
    sp = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[EOS])
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=8, kv_cache_dtype="fp8")
    want = LLMEngine(model, config).generate(PROMPTS, sp)
    monkeypatch.setenv("RLCU_TRITON", "1")
    engine = LLMEngine(model, config)
    got = engine.generate(PROMPTS, sp)
    assert got.completion_ids == want.completion_ids
    worst = max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs) for a, b in zip(x, y))
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_fp8_cache_costs_little_on_smollm2(smollm2_folder):
    """The real model, sampled at temperature 1 with an FP8 cache: the engine's logprobs against the training
    forward's (which attends in fp32) differ, as the cache rounds each key and value to 3 mantissa bits, but
    little; with the fp32 cache they agree to fp32 rounding."""
    model, tok = load_model(smollm2_folder)
    texts = ["What is 17 + 25? Give only the final number.", "Write a haiku about the sea.", "Name three colours."]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False).input_ids for t in texts]
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop_token_ids=[tok.eos_token_id])
    fp8 = logprob_gaps(model, LLMEngine(model, EngineConfig(kv_cache_dtype="fp8")).generate(ids * 2, sp), 1.0)
    fp32 = logprob_gaps(model, LLMEngine(model).generate(ids * 2, sp), 1.0)
    print(f"|engine - trainer| logprob, fp8 cache: mean {fp8.mean():.2e} max {fp8.max():.2e}; "
          f"fp32 cache: max {fp32.max():.2e}")
    assert fp32.max() < 1e-4
    assert 0.01 < fp8.mean() < 0.25 and fp8.max() < 2.0  # measured: mean 0.11, max 1.0 (docs/engine.md)


def test_fp8_pool_holds_twice_the_blocks(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"), dtype="bfloat16")
    assert pool.bytes_per_block(model, 16, "fp8") * 2 == pool.bytes_per_block(model, 16)
    engine = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8_e4m3", release_memory=False))
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0))
    assert engine.runner.k_cache.dtype == engine.runner.v_cache.dtype == FP8


def test_fp8_forks_and_preemption_copy_blocks(tmp_path):
    """A small pool forces preemption and copy-on-write of forked prompts' partial blocks: the FP8 bytes copy
    as any cache's do, so the greedy completions do not change."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    sp = SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[EOS])
    roomy = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8")).generate(PROMPTS, sp)
    engine = LLMEngine(model, EngineConfig(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32,
                                           kv_cache_dtype="fp8"))
    got = engine.generate(PROMPTS, sp)
    assert engine.stats["preemptions"] > 0
    assert got.completion_ids == roomy.completion_ids


def test_bad_kv_cache_dtype_is_a_clear_error_and_exact_numerics_follow_the_cache(tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'int8'"):
        NativeRollout({"kv_cache_dtype": "int8"})
    assert EngineConfig(kv_cache_dtype="fp8", numerics="exact").numerics is Numerics.EXACT_FP8
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", numerics="exact").numerics is Numerics.EXACT_FP8
    assert EngineConfig(numerics="exact").numerics is Numerics.EXACT
    assert NativeRollout({"kv_cache_dtype": "fp8"}).exact_numerics() is Numerics.EXACT_FP8
    with pytest.raises(ValueError, match="numerics exact_fp8 read an FP8 KV cache: set kv_cache_dtype: fp8"):
        EngineConfig(numerics="exact_fp8")


def test_the_shipped_fp8_fragment_gives_an_fp8_pool(tmp_path):
    """configs/rollout/native-fp8.yaml, as `--config` hands it to the native rollout."""
    fragment = Path(__file__).resolve().parents[2] / "configs/rollout/native-fp8.yaml"
    rollout = yaml.safe_load(fragment.read_text())["model"]["rollout"]
    assert rollout["name"] == "native"
    backend = NativeRollout(**rollout["init_args"])
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    backend.setup(model, None)
    backend.config.release_memory = False
    out = backend.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0))
    assert [len(c) for c in out.completion_ids] == [3, 3]
    assert backend.engine.runner.k_cache.dtype == FP8
