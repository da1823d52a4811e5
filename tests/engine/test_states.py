"""Recurrent state in the engine's pool, on a tiny random Qwen3.5 (Gated DeltaNet layers beside full attention,
built by transformers' own config class): prompts prefilled in chunks of 7 and 11 tokens, forks, parked and resumed
episodes and preemption each give what an unbroken computation gives, and every sampled token's logprob equals the
training forward's over the whole sequence, which keeps no state at all."""
import pytest
import torch

from rlcu.contracts import SamplingParams
from rlcu.engine import pool
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from tests.engine.test_multi_turn import Scripted, reference_episodes
from tests.helpers import EOS, logprob_gaps, reference_generate, tiny_hf_folder

LONG = [list(range(1, 41)), [3, 1, 4, 1, 5, 9, 2, 6] * 3, [7]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(tiny_hf_folder(tmp_path_factory.mktemp("m"), "qwen3_5_text", layers=4))[0]


def sampled(**kw):
    return SamplingParams(**{"max_tokens": 12, "temperature": 1.0, "seed": 5, "stop_token_ids": [EOS]} | kw)


def close(a, b):
    assert a.completion_ids == b.completion_ids
    assert max(abs(x - y) for p, q in zip(a.logprobs, b.logprobs) for x, y in zip(p, q)) < 1e-5


@pytest.mark.parametrize("chunk", [7, 11])
def test_prefill_in_chunks_equals_the_whole_prefill(model, chunk):
    prompts = LONG + [LONG[0]] * 2
    roomy = LLMEngine(model)
    whole = roomy.generate(prompts, sampled())
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=chunk, max_num_seqs=4))
    chunked = engine.generate(prompts, sampled())
    assert engine.stats["steps"] > roomy.stats["steps"]  # the 40-token prompt took several chunks
    close(chunked, whole)
    assert logprob_gaps(model, chunked).max() < 1e-4


def test_forks_equal_separate_prompts(model):
    prompts = [LONG[1]] * 4
    forked = LLMEngine(model).generate(prompts, sampled(temperature=0))
    alone = LLMEngine(model).generate(prompts[:1], sampled(temperature=0))
    for ids, lps in zip(forked.completion_ids, forked.logprobs):
        assert ids == alone.completion_ids[0]
        assert max(abs(x - y) for x, y in zip(lps, alone.logprobs[0])) < 1e-5
    assert logprob_gaps(model, LLMEngine(model).generate(prompts, sampled())).max() < 1e-4  # sampled forks part


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(num_blocks=10, max_num_seqs=4,
                                                                 max_num_batched_tokens=16)],
                         ids=["roomy", "tight-pool"])
def test_parked_and_resumed_episodes_equal_unbroken_ones(model, config):
    prompts = LONG + [LONG[2]] * 3
    sp = sampled(temperature=0, max_tokens=40, max_turn_tokens=6)
    engine = LLMEngine(model, config)
    got = engine.generate(prompts, sp, Scripted())
    want = reference_episodes(model, prompts, sp, Scripted())  # each turn from scratch
    assert got.completion_ids == want.completion_ids and got.tool_mask == want.tool_mask
    sampled_episodes = LLMEngine(model, config).generate(prompts, sampled(max_tokens=40, max_turn_tokens=6),
                                                         Scripted())
    gaps = logprob_gaps(model, sampled_episodes)
    mask = torch.tensor([m for ms in sampled_episodes.tool_mask for m in ms]).bool()
    assert gaps[mask].max() < 1e-4
    if config.num_blocks == 10:
        assert engine.stats["preemptions"] > 0  # parked episodes gave their blocks back and were recomputed


def test_preemption_recomputes_the_state(model):
    prompts = LONG + [LONG[1]] * 3
    engine = LLMEngine(model, EngineConfig(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=32, block_size=4))
    tight = engine.generate(prompts, sampled(max_tokens=20))
    assert engine.stats["preemptions"] > 0
    close(tight, LLMEngine(model).generate(prompts, sampled(max_tokens=20)))


def test_the_reference_backend_keeps_state_per_row(model):
    prompts = LONG + [[9, 8, 7]]
    sp = sampled(temperature=0)
    want = LLMEngine(model).generate(prompts, sp).completion_ids
    assert reference_generate(model, prompts, sp).completion_ids == want


def test_state_that_does_not_fit_is_a_clear_error(model, monkeypatch):
    monkeypatch.setattr(pool, "available_memory", lambda device: 1000)
    with pytest.raises(ValueError, match="recurrent state of 3 sequences .* raise memory_fraction"):
        LLMEngine(model).generate(LONG, sampled())


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
def test_decode_through_the_triton_step_kernel_under_the_interpreter(model, monkeypatch):
    """The engine's decode steps through our in-place Triton kernel (TRITON_INTERPRET=1 on the CPU), reading the
    layer's projection where it lies, against the PyTorch paths."""
    import rlcu.kernels.gated_delta as gd

    prompts = LONG + [LONG[1]] * 2
    want = LLMEngine(model).generate(prompts, sampled())
    calls = []
    real = gd._delta_triton
    monkeypatch.setattr(gd, "_delta_triton", lambda *a: calls.append(len(a[0])) or real(*a))
    monkeypatch.setattr(gd, "use_triton", lambda t: True)  # the step kernel only: attention stays on PyTorch
    close(LLMEngine(model).generate(prompts, sampled()), want)
    assert calls and max(calls) == len(prompts)


def test_a_model_of_linear_attention_layers_only_has_no_kv_to_hold(tmp_path):
    """No attention layer at all: the pool's blocks cost nothing, the states carry everything."""
    model = load_model(tiny_hf_folder(tmp_path, "qwen3_5_text", layers=3, layer_types=["linear_attention"]))[0]
    assert model.config.attention_layers == []
    out = LLMEngine(model, EngineConfig(max_num_batched_tokens=11, max_num_seqs=4)).generate(LONG + [LONG[0]] * 2,
                                                                                             sampled())
    assert logprob_gaps(model, out).max() < 1e-4


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_delta_rule_states_kept_narrow(model, name, dtype):
    """`mamba_ssm_cache_dtype` (vLLM's name): the pool keeps the delta rule's matrices in bf16 or fp16, half the
    bytes a slot holds for them (so a memory budget takes more sequences), each new state rounded once; the
    sampled tokens' logprobs then differ from the training forward's (fp32 states throughout) by that rounding
    alone, and the rollout's configuration takes it by name as YAML gives it."""
    from rlcu.rollout.native import NativeRollout

    cfg = model.config
    matrix = len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    wide, narrow = LLMEngine(model), LLMEngine(model, EngineConfig(mamba_ssm_cache_dtype=name, release_memory=False))
    assert wide._bytes_per_slot() - narrow._bytes_per_slot() == matrix * (4 - 2)
    prompts = LONG + [LONG[1]] * 2
    out = narrow.generate(prompts, sampled())
    assert narrow.runner.states.matrix.dtype == dtype
    gaps, fp32_gaps = logprob_gaps(model, out), logprob_gaps(model, wide.generate(prompts, sampled()))
    assert 4 * fp32_gaps.max() < gaps.max() < 0.02  # rounded (fp32 states: 5e-7 here), and by the rounding alone
    assert NativeRollout({"mamba_ssm_cache_dtype": name}).config.mamba_ssm_cache_dtype == name


def test_the_shipped_bf16_states_fragment(model):
    """configs/rollout/native-bf16-states.yaml, as `--config` hands it to the native rollout."""
    from pathlib import Path

    import yaml

    from rlcu.rollout.native import NativeRollout

    fragment = Path(__file__).resolve().parents[2] / "configs/rollout/native-bf16-states.yaml"
    rollout = yaml.safe_load(fragment.read_text())["model"]["rollout"]
    backend = NativeRollout(**rollout["init_args"])
    backend.setup(model, None)
    backend.config.release_memory = False
    out = backend.generate(LONG[:2], sampled(max_tokens=3))
    assert [len(c) for c in out.completion_ids] == [3, 3]
    assert backend.engine.runner.states.matrix.dtype == torch.bfloat16


def test_narrow_states_and_exact_logprobs_are_refused_together(model, tmp_path):
    from rlcu.contracts import Numerics

    with pytest.raises(ValueError, match="^mamba_ssm_cache_dtype must be one of .*, got 'fp8'"):
        EngineConfig(mamba_ssm_cache_dtype="fp8")
    with pytest.raises(ValueError, match="exact logprobs run the trainer's delta rule on fp32 states, and "
                                         "mamba_ssm_cache_dtype=bfloat16 rounds the sampler's: set"):
        LLMEngine(model, EngineConfig(numerics=Numerics.EXACT, mamba_ssm_cache_dtype="bfloat16"))
    dense = load_model(tiny_hf_folder(tmp_path, "qwen3"))[0]  # no delta rule: nothing to round
    LLMEngine(dense, EngineConfig(numerics=Numerics.EXACT, mamba_ssm_cache_dtype="bfloat16"))
    LLMEngine(model, EngineConfig(numerics=Numerics.EXACT, mamba_ssm_cache_dtype="auto"))  # fp32 model: fp32 states
