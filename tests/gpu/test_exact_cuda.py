"""exact_logprobs on the GPU: the engine (CUDA graphs, look-ahead, chunked prefill, decode steps of every
size as sequences stop) and the training forward give the same logprobs to the bit, in bf16 autocast over
fp32 weights as the recipes train and with bf16 weights (run on the H200)."""
import pytest
import torch

from rlcu.contracts import Numerics
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.engine.test_exact_logprobs import padded_batch, trainer_logprobs
from tests.helpers import tiny_hf_folder

pytestmark = pytest.mark.gpu


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 2, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma2", "gemma3_text", "mistral", "olmo2", "olmo3", "phi3",
                                    "granite", "smollm3", "seed_oss", "qwen3_moe", "gpt_oss", "olmoe", "qwen2_moe",
                                    "qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16-weights"])
def test_engine_and_trainer_logprobs_are_bitwise_equal_on_cuda(tmp_path, family, precision):
    model, _ = load_model(tiny_hf_folder(tmp_path, family, vocab_size=512, hidden=256, layers=3, heads=4, kv_heads=2,
                                         head_dim=64),
                          dtype="bfloat16" if precision == "bf16-weights" else "float32")
    model.cuda()
    rows = [p for p in prompts(24, 512) for _ in range(4)]  # 4 samples per prompt share its blocks
    sp = SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, stop_token_ids=list(range(10)), seed=1)
    autocast = precision == "bf16-autocast"
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=300, max_num_seqs=64, numerics=Numerics.EXACT))
        out = engine.generate(rows, sp)
        ids, mask, sampler, real = padded_batch(out)
        ids, mask = ids.cuda(), mask.cuda()
        lengths = real.sum(1)
        assert lengths.min() < lengths.max() and engine.stats["lookahead_steps"] > 0
        # every family decodes in CUDA graphs, the experts too (one grouped launch reading counts on the device)
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no graph was captured"
        for micro_batch in (len(ids), 7):
            trainer = trainer_logprobs(model, ids, mask, real.shape[1], micro_batch, 1.0).float().cpu()
            gap = (trainer - sampler)[real].abs().max().item()
            print(f"{family} {precision} micro-batch {micro_batch}: max |trainer - sampler| = {gap}")
            assert gap == 0.0


@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt_oss"])
def test_an_fp8_cache_keeps_engine_and_trainer_bitwise_equal_on_cuda(tmp_path, family):
    """Exact numerics over the engine's FP8 KV cache (EXACT_FP8, under bf16 autocast): the trainer's keys and values
    pass the same e4m3 rounding, on the GPU's own FP8 conversion."""
    model, _ = load_model(tiny_hf_folder(tmp_path, family, vocab_size=512, hidden=256, layers=3, heads=4, kv_heads=2,
                                         head_dim=64))
    model.cuda()
    rows = [p for p in prompts(16, 512) for _ in range(4)]
    sp = SamplingParams(max_tokens=64, temperature=1.0, stop_token_ids=list(range(10)), seed=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        config = EngineConfig(max_num_batched_tokens=300, max_num_seqs=64, numerics=Numerics.EXACT,
                              kv_cache_dtype="fp8")
        assert config.numerics is Numerics.EXACT_FP8
        out = LLMEngine(model, config).generate(rows, sp)
        ids, mask, sampler, real = padded_batch(out)
        trainer = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], 7, 1.0,
                                   numerics=Numerics.EXACT_FP8).float().cpu()
    gap = (trainer - sampler)[real].abs().max().item()
    print(f"{family} fp8 cache: max |trainer - sampler| = {gap}")
    assert gap == 0.0


def adapted_exact_gap(tmp_path, family: str, lora: bool, micro_batch: int | None) -> float:
    """max |trainer - sampler| of a tiny model's exact rollout under bf16 autocast, with LoRA r=16 on every linear
    layer (B trained-looking) if `lora`; the trainer records gradients, in micro-batches of `micro_batch` rows
    (None: all)."""
    from rlcu.models import add_lora
    from rlcu.models.lora import adapters

    model, _ = load_model(tiny_hf_folder(tmp_path, family, vocab_size=512, hidden=256, layers=3, heads=4, kv_heads=2,
                                         head_dim=64))
    if lora:
        add_lora(model, {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    model.cuda()
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.normal_(std=0.05)
    rows = [p for p in prompts(16, 512) for _ in range(4)]
    sp = SamplingParams(max_tokens=64, temperature=1.0, stop_token_ids=list(range(10)), seed=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = LLMEngine(model, EngineConfig(max_num_batched_tokens=300, max_num_seqs=64,
                                            numerics=Numerics.EXACT)).generate(rows, sp)
        ids, mask, sampler, real = padded_batch(out)
        with torch.enable_grad():
            trainer = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], micro_batch or len(ids), 1.0)
        assert trainer.requires_grad
    return (trainer.detach().float().cpu() - sampler)[real].abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3"])
def test_lora_adapters_keep_engine_and_trainer_bitwise_equal_on_cuda(tmp_path, family):
    """LoRA on every linear layer in exact mode (B's update in the base GEMM's launch, block-diagonal over the fused
    parts; Phi-3's checkpoint keeps qkv fused), under bf16 autocast over fp32 weights: the trainer records
    gradients, the engine replays CUDA graphs, and the logprobs agree to the bit."""
    gap = adapted_exact_gap(tmp_path, family, lora=True, micro_batch=7)
    print(f"{family} LoRA r=16: max |trainer - sampler| = {gap}")
    assert gap == 0.0


@pytest.mark.parametrize("lora", [False, True])
def test_training_takes_cublas_where_it_gives_the_kernels_bits(tmp_path, monkeypatch, lora):
    """From VENDOR_ROWS rows (the tiny model's training forward of all rows reaches it; the engine's prefill chunks
    of 300 tokens do not) the trainer's GEMMs take cuBLAS at the shapes where it gave the kernel's bits (LoRA's
    update then added by its own kernel): the logprobs still equal the sampler's to the bit, and cuBLAS was
    taken."""
    from rlcu.kernels import matmul

    monkeypatch.setattr(matmul, "VENDOR", matmul.VendorCheck())
    gap = adapted_exact_gap(tmp_path, "qwen3", lora, micro_batch=None)
    verdicts = matmul.VENDOR.verdicts
    print(f"cuBLAS at training rows, lora={lora}: {sum(verdicts.values())} of {len(verdicts)} shapes taken, "
          f"max |trainer - sampler| = {gap}")
    assert gap == 0.0 and any(verdicts.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exact_with_the_lm_head_cast_to_fp32(tmp_path, dtype):
    """TRL's cast_lm_head_to_fp32 in exact mode: the head's float32 GEMM through the batch-invariant kernel on both
    sides, over bf16 weights, and over fp32 weights under bf16 autocast."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", vocab_size=512, hidden=256, layers=3, heads=4, kv_heads=2,
                                         head_dim=64, tie_word_embeddings=False), dtype=dtype)
    model.cast_lm_head_to_fp32()
    model.cuda()
    rows = [p for p in prompts(16, 512) for _ in range(4)]
    sp = SamplingParams(max_tokens=64, temperature=1.0, stop_token_ids=list(range(10)), seed=1)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "float32"):
        out = LLMEngine(model, EngineConfig(max_num_batched_tokens=300, max_num_seqs=64,
                                            numerics=Numerics.EXACT)).generate(rows, sp)
        ids, mask, sampler, real = padded_batch(out)
        trainer = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], 7, 1.0).float().cpu()
    gap = (trainer - sampler)[real].abs().max().item()
    print(f"cast_lm_head_to_fp32 {dtype}: max |trainer - sampler| = {gap}")
    assert gap == 0.0


@pytest.mark.slow
def test_smollm2_exact_under_autocast(smollm2_folder):
    model, tok = load_model(smollm2_folder)
    model.cuda()
    texts = ["What is 17 + 25? Give only the final number.", "Hi", "Name three colours.", "What is 3 * 14?"]
    rows = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False).input_ids for t in texts for _ in range(8)]
    sp = SamplingParams(max_tokens=64, temperature=1.0, stop_token_ids=[tok.eos_token_id], seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = LLMEngine(model, EngineConfig(numerics=Numerics.EXACT)).generate(rows, sp)
        ids, mask, sampler, real = padded_batch(out)
        trainer = trainer_logprobs(model, ids.cuda(), mask.cuda(), real.shape[1], 5, 1.0).float().cpu()
    assert torch.equal(trainer[real], sampler[real]), (trainer - sampler)[real].abs().max()
