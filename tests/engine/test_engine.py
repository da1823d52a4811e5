"""The native engine against the reference backend and transformers' generate (greedy, token for token),
its logprobs against the training forward, and its block accounting under preemption."""
import random

import pytest
import torch
import transformers

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from rlcu.rollout.native import NativeRollout
from tests.helpers import EOS, PROMPTS, tiny_hf_folder
from tests.helpers import reference_generate as reference


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(max_num_batched_tokens=20, max_num_seqs=4),
                                    EngineConfig(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)],
                         ids=["roomy", "chunked-prefill", "preempting"])
def test_greedy_matches_reference_backend(tmp_path, family, config):
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    sp = SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[EOS])
    engine = LLMEngine(model, config)
    got = engine.generate(PROMPTS, sp)
    want = reference(model, PROMPTS, sp)
    assert got.completion_ids == want.completion_ids and got.finish_reasons == want.finish_reasons
    if config.num_blocks == 12:
        assert engine.stats["preemptions"] > 0  # the pool is too small for all at once: preemption was exercised


def test_mixed_max_lengths_and_transformers_generate(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    model, _ = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine(model)
    for max_tokens in (1, 5, 19):
        out = engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=[EOS]))
        for prompt, got in zip(PROMPTS, out.completion_ids):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS,
                              pad_token_id=62)[0, len(prompt):].tolist()
            assert got == (ref[:ref.index(EOS) + 1] if EOS in ref else ref)


def test_sampled_logprobs_match_training_forward(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, stop_token_ids=[EOS], seed=3)
    out = LLMEngine(model, EngineConfig(max_num_batched_tokens=24, max_num_seqs=8)).generate(PROMPTS, sp)
    worst = 0.0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), sp.temperature)
        worst = max(worst, (ref[0] - torch.tensor(lp)).abs().max().item())
    print(f"max |engine - trainer| logprob: {worst:.2e}")
    assert worst < 1e-4
    forks = out.completion_ids[4:7]  # three samples of one prompt: shared prefill, independent sampling
    assert len({tuple(c) for c in forks}) > 1


@pytest.mark.slow
def test_block_accounting_after_1000_requests_with_preemption(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama", layers=1, hidden=32, heads=2, kv_heads=1))
    rng = random.Random(0)
    prompts = []
    for _ in range(250):  # 250 prompts x 4 samples = 1000 requests
        p = [rng.randrange(60) for _ in range(rng.randint(1, 40))]
        prompts += [p] * 4
    engine = LLMEngine(model, EngineConfig(num_blocks=40, max_num_seqs=32, max_num_batched_tokens=64))
    out = engine.generate(prompts, SamplingParams(max_tokens=24, stop_token_ids=[EOS], seed=0))
    assert len(out) == 1000 and all(1 <= len(c) <= 24 for c in out.completion_ids)
    assert all((r == "stop") == (c[-1] == EOS) for c, r in zip(out.completion_ids, out.finish_reasons))
    assert engine.stats["preemptions"] > 0  # generate() itself raises if any block leaked


def test_forked_samples_count_against_max_num_seqs(tmp_path, monkeypatch):
    """Prompts admitted in one step fork their samples after it: the admission counts those samples too, so
    the running batch stays within max_num_seqs (CUDA graphs are captured up to that size)."""
    import rlcu.engine.model_runner as runner

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    sizes = []
    real = runner.ModelRunner.decode
    monkeypatch.setattr(runner.ModelRunner, "decode",
                        lambda self, seqs, *a, **k: sizes.append(len(seqs)) or real(self, seqs, *a, **k))
    prompts = [p for p in PROMPTS for _ in range(4)]
    sp = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[EOS])
    got = LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(prompts, sp)
    assert sizes and max(sizes) == 8, str(sizes)
    assert got.completion_ids == reference(model, prompts, sp).completion_ids


def test_a_request_larger_than_the_pool_is_a_clear_error(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    with pytest.raises(ValueError, match="needs 3 KV blocks but the pool has 2"):
        LLMEngine(model, EngineConfig(num_blocks=2)).generate([[1] * 20], SamplingParams(max_tokens=20))


def test_native_backend_shares_parameters_and_sees_updates(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen2"))  # untied: a tiny tied model just echoes its input
    backend = NativeRollout()
    backend.setup(model, None)
    assert backend.model is model
    greedy = SamplingParams(max_tokens=8, temperature=0)
    before = backend.generate(PROMPTS, greedy).completion_ids
    backend.release()
    with torch.no_grad():
        model.lm_head.weight.neg_()  # in place, as optimizer.step() updates parameters
    assert backend.generate(PROMPTS, greedy).completion_ids != before


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_a_rollout_stops_between_decode_steps_when_asked_and_the_next_one_runs_whole(tmp_path, backend):
    from rlcu.contracts import GenerationInterrupted
    from rlcu.rollout import resolve_rollout, turns

    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    rollout = resolve_rollout(backend)
    rollout.setup(model, None)
    asked = []

    def stop_after_three_looks():
        asked.append(1)
        return len(asked) >= 3

    long = SamplingParams(max_tokens=200, temperature=1.0, seed=0)  # no stop token: every request runs 200 tokens
    with pytest.raises(GenerationInterrupted, match="asked to stop while the rollout was decoding"):
        turns.generate(rollout, PROMPTS, long, should_stop=stop_after_three_looks)
    assert len(asked) == 3  # it looked every few decode steps, and stopped at the first yes
    out = turns.generate(rollout, PROMPTS, long, should_stop=lambda: False)
    assert [len(c) for c in out.completion_ids] == [200] * len(PROMPTS)


@pytest.mark.slow
def test_smollm2_greedy_matches_reference_and_transformers(smollm2_folder):
    model, tok = load_model(smollm2_folder)
    texts = ["What is 17 + 25? Give only the final number.", "Hi", "Write a haiku about the sea, please."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in texts]
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    ids = [ids[0], ids[0], ids[1], ids[2]]
    sp = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tok.eos_token_id])
    got = LLMEngine(model, EngineConfig(max_num_batched_tokens=48, max_num_seqs=8)).generate(ids, sp)
    assert got.completion_ids == reference(model, ids, sp).completion_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    for p, c in zip(ids, got.completion_ids):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert c == ref[:len(c)] and (len(c) == 24 or c[-1] == tok.eos_token_id)


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
def test_greedy_parity_with_triton_kernels_under_the_interpreter(tmp_path, monkeypatch):
    """The engine with its Triton kernels (KV write with Qwen3's q/k norms, paged decode) run by
    TRITON_INTERPRET=1 on the CPU, fp32."""
    import rlcu.engine.paged_attention as paged
    import rlcu.kernels.decode_attention as decode

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=64, heads=6, kv_heads=2, head_dim=64))
    sp = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS])
    want = reference(model, PROMPTS, sp)
    monkeypatch.setenv("RLCU_TRITON", "1")
    calls, normed = [], []
    real = decode.decode_attention_triton
    monkeypatch.setattr(decode, "decode_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_rope = paged.rope_store_kv
    monkeypatch.setattr(paged, "rope_store_kv", lambda *a: normed.append(len(a) == 12) or real_rope(*a))
    got = LLMEngine(model, EngineConfig(max_num_batched_tokens=32, max_num_seqs=8)).generate(PROMPTS, sp)
    assert calls, "the Triton decode kernel did not run"
    assert normed and all(normed), "the q/k norms were not fused into the RoPE + KV-write kernel"
    assert got.completion_ids == want.completion_ids


def triton_attention_with_reference_rope(monkeypatch):
    """The Triton kernels under the interpreter, but the RoPE + KV-write step through its PyTorch reference: the
    tests of the attention kernels need their inputs, not that kernel again (test_greedy_parity_with_triton_kernels
    and tests/kernels/test_rope_store_kv.py cover it), and it adds half again to their interpreter time."""
    import rlcu.engine.paged_attention as paged
    from rlcu.kernels.rope_store_kv import rope_store_kv_reference

    monkeypatch.setenv("RLCU_TRITON", "1")
    monkeypatch.setattr(paged, "rope_store_kv", rope_store_kv_reference)


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
@pytest.mark.parametrize("config", [EngineConfig(block_size=4, shared_prefix=True),
                                    pytest.param(EngineConfig(block_size=4, num_blocks=40, max_num_seqs=6,
                                                              shared_prefix=True), marks=pytest.mark.slow)],
                         ids=["roomy", "preempting"])
def test_shared_prefix_decode_under_the_interpreter(tmp_path, monkeypatch, config):
    """Decode with the samples of a prompt reading its shared blocks once (Triton kernel, interpreter, fp32):
    greedy completions equal the reference backend's, and sampled ones equal the plain kernel's."""
    import rlcu.engine.paged_attention as paged

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=64, heads=6, kv_heads=2, head_dim=64))
    triton_attention_with_reference_rope(monkeypatch)
    calls = []
    real = paged.shared_prefix_decode_triton
    monkeypatch.setattr(paged, "shared_prefix_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    greedy = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[EOS])
    got = LLMEngine(model, config).generate(PROMPTS, greedy)
    assert calls, "the shared-prefix kernel did not run"
    assert got.completion_ids == reference(model, PROMPTS, greedy).completion_ids
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    plain = EngineConfig(block_size=config.block_size, num_blocks=config.num_blocks, max_num_seqs=config.max_num_seqs)
    assert (LLMEngine(model, config).generate(PROMPTS, sampled).completion_ids
            == LLMEngine(model, plain).generate(PROMPTS, sampled).completion_ids)


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")
def test_shared_prefix_by_default_only_on_large_decode_steps(tmp_path, monkeypatch):
    """The default (shared_prefix=None) groups samples only at decode steps of SHARED_PREFIX_MIN_SEQS or more
    (here lowered to 10): as sequences stop, the smaller steps go back to the plain kernel."""
    import rlcu.engine.model_runner as runner
    import rlcu.engine.paged_attention as paged

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32))
    triton_attention_with_reference_rope(monkeypatch)
    monkeypatch.setattr(runner, "SHARED_PREFIX_MIN_SEQS", 10)
    steps, grouped = [], []
    real_decode, real_shared = runner.ModelRunner.decode, paged.shared_prefix_decode_triton
    monkeypatch.setattr(runner.ModelRunner, "decode",
                        lambda self, seqs, *a, **k: steps.append(len(seqs)) or real_decode(self, seqs, *a, **k))
    monkeypatch.setattr(paged, "shared_prefix_decode_triton",
                        lambda q, *a, **k: grouped.append(q.shape[0]) or real_shared(q, *a, **k))
    prompts = [p for p in PROMPTS[:4] for _ in range(3)]
    # 8 of the 64 tokens stop a sequence: enough of the 12 end early for the last steps to hold fewer than 10
    sp = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=[EOS, 3, 11, 29, 40, 47, 52, 58], seed=5)
    got = LLMEngine(model, EngineConfig(block_size=4)).generate(prompts, sp)
    assert grouped and min(grouped) >= 10 and min(steps) < 10, (steps, grouped)
    plain = LLMEngine(model, EngineConfig(block_size=4, shared_prefix=False)).generate(prompts, sp)
    assert got.completion_ids == plain.completion_ids


def test_stop_strings_end_completions_in_both_backends(tmp_path):
    from rlcu.data.tokenizers import word_tokenizer

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen2"))
    tok = word_tokenizer(64)
    free = SamplingParams(max_tokens=12, temperature=0)
    full = LLMEngine(model).generate(PROMPTS, free).completion_ids
    target = full[1][3]  # a token the greedy completion of prompt 1 emits at position 3 (or earlier)
    stop = f"t{target}"
    sp = SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    native = LLMEngine(model, tokenizer=tok).generate(PROMPTS, sp)
    ref = reference(model, PROMPTS, sp, tokenizer=tok)
    assert native.completion_ids == ref.completion_ids and native.finish_reasons == ref.finish_reasons
    cut = native.completion_ids[1]
    assert native.finish_reasons[1] == "stop" and cut == full[1][:len(cut)] and stop in tok.decode(cut)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        LLMEngine(model).generate(PROMPTS, sp)


@pytest.mark.parametrize("config", [dict(), dict(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)],
                         ids=["roomy", "preempting"])
def test_lookahead_changes_nothing(tmp_path, config):
    """Launching decode step n+1 before the host has step n's tokens (`lookahead`) samples exactly what the
    step-by-step loop samples, including sequences that stop while their next step is already running."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    sp = SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=[EOS, 3, 11, 29], seed=5)  # frequent stops
    prompts = PROMPTS * 3
    ahead = LLMEngine(model, EngineConfig(lookahead=True, **config))
    got = ahead.generate(prompts, sp)
    want = LLMEngine(model, EngineConfig(lookahead=False, **config)).generate(prompts, sp)
    assert got.completion_ids == want.completion_ids and got.finish_reasons == want.finish_reasons
    assert max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs) for a, b in zip(x, y)) < 1e-5
    stopped_early = [len(c) < sp.max_tokens for c, r in zip(got.completion_ids, got.finish_reasons) if r == "stop"]
    assert ahead.stats["lookahead_steps"] > 0 and sum(stopped_early) >= 3, (ahead.stats, got.finish_reasons)


def test_shared_prefix_without_triton_says_so_once(tmp_path, caplog):
    """On the PyTorch path the option cannot act: one warning per engine, and the completions are the plain ones."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    engine = LLMEngine(model, EngineConfig(shared_prefix=True))
    sp = SamplingParams(max_tokens=4, temperature=0)
    with caplog.at_level("WARNING", logger="rlcu.engine.llm_engine"):
        got = [engine.generate(PROMPTS, sp) for _ in range(2)]
    assert sum("shared_prefix needs the Triton kernels" in r.message for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlcu.engine.llm_engine"):
        plain = LLMEngine(model).generate(PROMPTS, sp)  # the default (auto) asks for nothing: no warning
    assert got[0].completion_ids == plain.completion_ids and not caplog.records


@pytest.mark.parametrize("config", [EngineConfig(),
                                    EngineConfig(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=32)],
                         ids=["roomy", "preempting"])
def test_the_engine_reports_each_completion_once_as_it_ends(tmp_path, config):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    engine = LLMEngine(model, config)
    seen: dict[int, tuple[list[int], str, int]] = {}

    def on_finished(turn):
        assert turn.request not in seen
        seen[turn.request] = (list(turn.completion_ids), turn.finish_reason, len(engine.scheduler.running))

    prompts = [p for p in PROMPTS for _ in range(3)]  # forks of each prompt report apart
    sp = SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=list(range(0, 64, 3)), seed=5)
    out = engine.generate(prompts, sp, on_finished=on_finished)
    assert sorted(seen) == list(range(len(prompts)))
    assert [seen[i][0] for i in range(len(prompts))] == out.completion_ids
    assert [seen[i][1] for i in range(len(prompts))] == out.finish_reasons
    assert len({len(c) for c in out.completion_ids}) > 1  # uneven lengths, so ...
    assert any(running > 0 for _, _, running in seen.values())  # ... some were reported while others decoded
    if config.num_blocks:
        assert engine.stats["preemptions"] > 0  # a preempted sequence is reported once, when it really ends


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_equals_transformers_generate(tmp_path, penalty):
    """TRL's repetition_penalty with its meaning (transformers' and vLLM's: prompt tokens count too), in the engine,
    forks and chunked prefill included, and in the reference backend."""
    import transformers

    folder = tiny_hf_folder(tmp_path, "qwen3")
    model, _ = load_model(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sp = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS], repetition_penalty=penalty)
    got = LLMEngine(model, EngineConfig(max_num_batched_tokens=16, max_num_seqs=8)).generate(PROMPTS, sp)
    assert reference(model, PROMPTS, sp).completion_ids == got.completion_ids
    for prompt, ids in zip(PROMPTS, got.completion_ids):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                            pad_token_id=62, repetition_penalty=penalty)[0, len(prompt):].tolist()
        assert ids == (want[:want.index(EOS) + 1] if EOS in want else want)
    if penalty > 1:  # the tiny model's greedy tokens repeat: a penalty above 1 changes them
        plain = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS]))
        assert plain.completion_ids != got.completion_ids


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_a_windowed_model_gives_back_the_blocks_before_its_window(tmp_path, monkeypatch, tight):
    """Mistral with a window of 3 in every layer, blocks of 2 tokens and key tiles of 2 (the kernels' are 128): each
    sequence holds a few blocks whatever its length, so 4 sequences of 150 new tokens (76 blocks for the shortest)
    run in 16 blocks (6 with preemptions), forks and multi-turn episodes included; greedy tokens equal
    transformers'."""
    import rlcu.engine.llm_engine as llm_engine
    from rlcu.contracts import Reply

    monkeypatch.setattr(llm_engine, "KEY_TILE", 2)
    folder = tiny_hf_folder(tmp_path, "mistral", sliding_window=3)
    model = load_model(folder)[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = EngineConfig(block_size=2, num_blocks=6 if tight else 16, max_num_seqs=4, max_num_batched_tokens=4)
    engine = LLMEngine(model, config)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[2], PROMPTS[3]]  # the middle two: forks sharing a prompt's blocks
    out = engine.generate(prompts, SamplingParams(max_tokens=150, temperature=0))
    for prompt, got in zip(prompts, out.completion_ids):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=150, do_sample=False, eos_token_id=None,
                            pad_token_id=62)[0, len(prompt):].tolist()
        assert got == want
    assert (engine.stats["preemptions"] > 0) == tight  # generate() itself raises if any block leaked
    episodes = engine.generate(prompts, SamplingParams(max_tokens=150, max_turn_tokens=40, temperature=0),
                               lambda turn: Reply([5, 6, 7]) if len(turn.completion_ids) < 100 else Reply(None))
    assert all(len(c) > 100 for c in episodes.completion_ids)
    unwindowed = LLMEngine(model, EngineConfig(block_size=2, num_blocks=16, max_num_seqs=4))
    monkeypatch.setattr(llm_engine.LLMEngine, "_release_window", lambda self: None)
    with pytest.raises(ValueError, match="needs 76 KV blocks but the pool has 16"):
        unwindowed.generate(prompts, SamplingParams(max_tokens=150, temperature=0))
