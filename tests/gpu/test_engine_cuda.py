"""The native engine on the GPU: Triton kernels, bf16, against the reference backend (run on the H200)."""
import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import DENSE_FAMILIES, EOS, PROMPTS, logprob_gaps, tiny_hf_folder
from tests.helpers import reference_generate as reference

pytestmark = pytest.mark.gpu


def test_greedy_parity_fp32_on_cuda(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=6, kv_heads=2, head_dim=64))
    model.cuda()
    sp = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[EOS])
    got = LLMEngine(model, EngineConfig(max_num_batched_tokens=40, max_num_seqs=8)).generate(PROMPTS, sp)
    want = reference(model, PROMPTS, sp)
    same = sum(a == b for a, b in zip(got.completion_ids, want.completion_ids))
    assert same >= len(PROMPTS) - 1, f"{same}/{len(PROMPTS)} identical (fp32 matmuls use tf32 on the GPU)"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smollm2_on_cuda_matches_reference_with_dtype_tolerance(smollm2_folder, dtype):
    model, tok = load_model(smollm2_folder, dtype=dtype)
    model.cuda()
    texts = ["What is 17 + 25? Give only the final number.", "Hi", "Name three colours.", "What is 3 * 14?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False).input_ids for t in texts]
    greedy = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tok.eos_token_id])
    got = LLMEngine(model).generate(ids, greedy)
    want = reference(model, ids, greedy)
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(got.completion_ids, want.completion_ids)]
    assert sum(p >= 8 for p in prefix) >= 3, f"identical greedy prefixes: {prefix}"
    sp = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
    gaps = logprob_gaps(model, LLMEngine(model).generate([x for x in ids for _ in range(4)], sp))
    print(f"{dtype}: engine vs trainer logprob |diff| mean {gaps.mean():.2e} max {gaps.max():.2e}")
    assert gaps.mean() < (0.05 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("release_memory", [True, False])
def test_cuda_graph_decode_matches_eager(tmp_path, release_memory):
    """The same sampled run with and without decode graphs (bucket padding included: 11 sequences run
    in the 16-row graph), twice in a row so a kept pool and its graphs are reused."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=32))
    model.cuda()
    prompts = [p for p in PROMPTS[:4] for _ in range(3)][:11]
    sp = SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=[EOS], seed=3)
    eager = LLMEngine(model, EngineConfig(cuda_graphs=False)).generate(prompts, sp)
    engine = LLMEngine(model, EngineConfig(cuda_graphs=True, release_memory=release_memory))
    for _ in range(2):
        graphed = engine.generate(prompts, sp)
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no graph was captured"
        assert graphed.completion_ids == eager.completion_ids
        gap = max(abs(a - b) for x, y in zip(graphed.logprobs, eager.logprobs) for a, b in zip(x, y))
        assert gap < 1e-4, gap
        engine.release()
    assert (engine.runner is None) == release_memory


@pytest.mark.parametrize("max_num_seqs", [256, 8], ids=["all-at-once", "staggered"])
def test_lookahead_with_cuda_graphs_matches_step_by_step(tmp_path, max_num_seqs):
    """Decode step n+1 launched (as a graph) on the GPU's tokens before the host copied them out: the
    host waits on the pinned copies only, and sequences that stop meanwhile are dropped. Staggered: 8
    running at a time, so sequences reach their length at different steps and the look-ahead keeps a
    subset of the rows."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=32))
    model.cuda()
    prompts = PROMPTS * 3
    sp = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[EOS, 3, 11, 29], seed=7)
    ahead = LLMEngine(model, EngineConfig(cuda_graphs=True, lookahead=True, max_num_seqs=max_num_seqs))
    got = ahead.generate(prompts, sp)
    plain = LLMEngine(model, EngineConfig(cuda_graphs=True, lookahead=False, max_num_seqs=max_num_seqs))
    want = plain.generate(prompts, sp)
    assert ahead.stats["lookahead_steps"] > 0 and ahead.runner.graphs.graphs
    # rows computed for sequences that stopped change a step's graph bucket, and with it cuBLAS's
    # summation order: a near-tie may flip one draw
    same = sum(a == b for a, b in zip(got.completion_ids, want.completion_ids))
    assert same >= len(prompts) - 1, f"{same}/{len(prompts)} identical"


@pytest.mark.parametrize("max_num_seqs", [256, 8], ids=["all-at-once", "staggered"])
def test_shared_prefix_decode_with_cuda_graphs_matches_plain(tmp_path, max_num_seqs):
    """The samples of each prompt read its shared blocks once (graphs, look-ahead, groups changing as
    sequences stop): greedy completions equal the reference backend's, sampled ones the plain kernel's."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=32))
    model.cuda()
    prompts = [p for p in PROMPTS for _ in range(4)]  # four samples of each prompt, as GRPO asks for them
    shared = EngineConfig(cuda_graphs=True, max_num_seqs=max_num_seqs, block_size=4, shared_prefix=True)
    plain = EngineConfig(cuda_graphs=True, max_num_seqs=max_num_seqs, block_size=4)
    greedy = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[EOS])
    engine = LLMEngine(model, shared)
    got = engine.generate(prompts, greedy)
    assert any(key[2] for key in engine.runner.graphs.graphs), "no shared-prefix graph was captured"
    want = reference(model, prompts, greedy)
    same = sum(a == b for a, b in zip(got.completion_ids, want.completion_ids))
    assert same >= len(prompts) - 2, f"{same}/{len(prompts)} identical (fp32 matmuls use tf32 on the GPU)"
    sp = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[EOS, 3, 11, 29], seed=7)
    a, b = LLMEngine(model, shared).generate(prompts, sp), LLMEngine(model, plain).generate(prompts, sp)
    same = sum(x == y for x, y in zip(a.completion_ids, b.completion_ids))
    assert same >= len(prompts) - 2, f"{same}/{len(prompts)} identical"


def test_lora_adapters_run_inside_the_cuda_graphs_and_follow_in_place_updates(tmp_path):
    """Base + adapter in bf16 decode graphs: the engine's sampled logprobs match the training forward of the
    same tokens, and an in-place change of the adapters changes the next rollout (the graphs read them)."""
    from rlcu.models import add_lora
    from rlcu.models.lora import adapters

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=6, kv_heads=2, head_dim=64))
    add_lora(model, {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.normal_(std=0.05)
    model.cuda().to(torch.bfloat16).eval()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=16, release_memory=False))
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
    first = engine.generate(PROMPTS, sp)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no graph was captured"
    worst = 0.0
    for p, c, lp in zip(first.prompt_ids, first.completion_ids, first.logprobs):
        ids = torch.tensor([p + c], device="cuda")
        ref, _ = completion_logprobs(model, ids, None, len(c), sp.temperature)
        worst = max(worst, (ref[0].float().cpu() - torch.tensor(lp)).abs().max().item())
    assert worst < 0.1, f"engine vs training logprobs differ by {worst} (bf16)"
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.mul_(-20.0)
    again = engine.generate(PROMPTS, sp)
    assert again.completion_ids != first.completion_ids


def test_fp8_kv_cache_in_graphs_with_shared_prefix(tmp_path):
    """kv_cache_dtype fp8 on the GPU, bf16: decode graphs with shared-prefix decode against eager plain decode
    over the same FP8 cache (the same sampled completions, but for near-ties), and the engine's logprobs near
    the training forward's."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=64),
                          dtype="bfloat16")
    model.cuda()
    prompts = [p for p in PROMPTS for _ in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[EOS], seed=7)
    fast = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8", shared_prefix=True, block_size=4, release_memory=False))
    got = fast.generate(prompts, sp)
    assert fast.runner.k_cache.dtype == torch.float8_e4m3fn and any(key[2] for key in fast.runner.graphs.graphs)
    want = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8", cuda_graphs=False, shared_prefix=False,
                                         block_size=4)).generate(prompts, sp)
    same = sum(a == b for a, b in zip(got.completion_ids, want.completion_ids))
    assert same >= len(prompts) - 2, f"{same}/{len(prompts)} identical"
    gaps = logprob_gaps(model, got)
    print(f"fp8 cache: engine vs trainer logprob |diff| mean {gaps.mean():.2e} max {gaps.max():.2e}")
    assert gaps.mean() < 0.25


@pytest.mark.parametrize("family", [*sorted(DENSE_FAMILIES), "gpt_oss"])
def test_families_greedy_on_cuda_equal_transformers(tmp_path, family):
    """The engine's Triton kernels (sliding windows, attention sinks, CUDA graphs) on each family, fp32, against
    transformers."""
    import transformers

    folder = tiny_hf_folder(tmp_path, family, hidden=128, heads=4, kv_heads=2, head_dim=64)
    model = load_model(folder)[0].cuda()
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[EOS]))
    for prompt, got in zip(PROMPTS, out.completion_ids):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS,
                            pad_token_id=62)[0, len(prompt):].tolist()
        assert got == (want[:want.index(EOS) + 1] if EOS in want else want)


def test_requests_added_mid_rollout_sample_on_graphs_as_they_would_up_front(tmp_path):
    """A continuation's spawned requests (an agent program's branches) join running decode graphs mid-rollout and
    draw the same tokens as the same prompts given up front: exact numerics make each row's bits independent of
    the batch it runs in, so the two rollouts agree token for token at temperature 1."""
    from dataclasses import replace

    from rlcu.contracts import Numerics
    from tests.engine.test_multi_turn import Scripted, Spawning

    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=32))
    model.cuda()
    prompts = PROMPTS[:5]
    sp = SamplingParams(max_tokens=40, max_turn_tokens=6, temperature=1.0, seed=3, stop_token_ids=[EOS])
    config = EngineConfig(numerics=Numerics.EXACT)
    spawning = Spawning(prompts)
    out = LLMEngine(model, config).generate(prompts, sp, spawning)
    assert len(out) == 10 and out.prompt_ids[5:] == [spawning.added[i] for i in range(5, 10)]
    alone = LLMEngine(model, config).generate(out.prompt_ids, replace(sp, first_turn_tokens=[None] * 5 + [4] * 5),
                                              Scripted())
    assert out.completion_ids == alone.completion_ids and out.tool_mask == alone.tool_mask
