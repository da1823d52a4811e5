"""exact_logprobs: the engine's sampled logprobs equal the training forward's bit for bit, however the engine
batched the work (prefill chunks of several sizes, decode steps of several batch sizes, forks sharing their
prompt's blocks) and however training splits the batch into micro-batches. Triton's CPU interpreter, fp32;
the H200 runs the same in bf16 autocast (tests/gpu/test_exact_cuda.py)."""
import pytest
import torch

import rlcu.kernels.matmul as matmul
from rlcu.contracts import Numerics
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.grpo.logprobs import completion_logprobs
from rlcu.kernels._triton import HAS_TRITON
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import EOS, PROMPTS, tiny_hf_folder

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines"),
              pytest.mark.usefixtures("fixed_order_dot")]

SAMPLING = SamplingParams(max_tokens=6, temperature=0.8, stop_token_ids=[EOS], seed=7)
# prompts of 1 to 33 tokens; the repeated ones fork, their samples sharing the prompt's blocks
PROMPTS_ = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[7], PROMPTS[2]]
EXACT = Numerics.EXACT
CONFIGS = {"whole-prompts": EngineConfig(block_size=16, numerics=EXACT),
           "chunks-of-7-decode-by-3": EngineConfig(block_size=4, max_num_batched_tokens=7, max_num_seqs=3,
                                                   numerics=EXACT),
           "chunks-of-11-decode-by-5": EngineConfig(block_size=8, max_num_batched_tokens=11, max_num_seqs=5,
                                                    numerics=EXACT)}


def padded_batch(out):
    """The rollout as the trainer receives it: prompts left-padded, completions right-padded."""
    p_len = max(len(p) for p in out.prompt_ids)
    c_len = max(len(c) for c in out.completion_ids)
    ids = torch.zeros(len(out.prompt_ids), p_len + c_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(out.prompt_ids, out.completion_ids)):
        ids[i, p_len - len(p):p_len + len(c)] = torch.tensor(p + c)
        mask[i, p_len - len(p):p_len + len(c)] = 1
    sampler = torch.zeros(len(out.prompt_ids), c_len)
    for i, lp in enumerate(out.logprobs):
        sampler[i, :len(lp)] = torch.tensor(lp)
    return ids, mask, sampler, mask[:, p_len:].bool()


def trainer_logprobs(model, ids, mask, c_len, micro_batch: int, temperature=SAMPLING.temperature,
                     numerics=EXACT) -> torch.Tensor:
    return torch.cat([completion_logprobs(model, ids[i:i + micro_batch], mask[i:i + micro_batch], c_len,
                                          temperature, numerics=numerics)[0] for i in range(0, len(ids), micro_batch)])


def split_k(x, weight, bias=None, low_rank=None, real=matmul.linear_triton):
    """The batch-invariant GEMM with K summed in two halves, each half's sum rounded and then added: the same
    function in another order."""
    h = x.shape[1] // 2
    low = real(x[:, :h].contiguous(), weight[:, :h].contiguous()).float()
    return (low + real(x[:, h:].contiguous(), weight[:, h:].contiguous(), bias, low_rank).float()).to(x.dtype)


def exact_model(tmp_path, monkeypatch, family: str = "qwen3"):
    monkeypatch.setenv("RLCU_TRITON", "1")
    model, _ = load_model(tiny_hf_folder(tmp_path, family, hidden=64, heads=4, kv_heads=2, head_dim=16))
    model.check_numerics(EXACT)
    return model


@pytest.mark.parametrize("family,config", [("qwen3", "whole-prompts"), ("qwen3", "chunks-of-7-decode-by-3"),
                                           ("llama", "chunks-of-11-decode-by-5"),
                                           # sliding windows of 5, `1 + w` norms, GeGLU; partial RoPE
                                           ("gemma3_text", "chunks-of-7-decode-by-3"), ("phi3", "whole-prompts"),
                                           # soft-capped scores and logits
                                           ("gemma2", "chunks-of-7-decode-by-3"),
                                           # routing and expert sums of a mixture of experts
                                           ("qwen3_moe", "chunks-of-7-decode-by-3"),
                                           # attention sinks, biased router and experts, alternating windows
                                           ("gpt_oss", "chunks-of-7-decode-by-3"),
                                           # q/k norms over the whole projection; a shared expert beside the routed
                                           ("olmoe", "whole-prompts"), ("qwen2_moe", "chunks-of-7-decode-by-3"),
                                           # Gated DeltaNet beside full attention: states across chunks and forks
                                           # (Qwen3-Next's experts beside it: tests/gpu/test_exact_cuda.py)
                                           ("qwen3_5_text", "chunks-of-7-decode-by-3")])
@pytest.mark.slow
def test_engine_logprobs_equal_the_training_forward_bit_for_bit(tmp_path, monkeypatch, family, config):
    """Qwen3 (q/k norms) and Llama/SmolLM2 (tied embeddings); micro-batches of all rows and of 3. Then the
    check's teeth: the same GEMM summing K in two halves added afterwards (split-K), in training only, breaks
    equality."""
    model = exact_model(tmp_path, monkeypatch, family)
    out = LLMEngine(model, CONFIGS[config]).generate(PROMPTS_, SAMPLING)
    ids, mask, sampler, real = padded_batch(out)
    assert real.sum() > 20
    for micro_batch in (len(ids), 3):
        trainer = trainer_logprobs(model, ids, mask, real.shape[1], micro_batch)
        assert torch.equal(trainer[real], sampler[real]), (trainer - sampler)[real].abs().max()
    if config == "whole-prompts":
        monkeypatch.setattr(matmul, "linear_triton", split_k)
        gap = (trainer_logprobs(model, ids, mask, real.shape[1], len(ids)) - sampler)[real].abs().max()
        assert 0 < gap < 1e-4, gap  # the same function, rounded elsewhere


def test_an_fp8_cache_keeps_the_logprobs_bit_for_bit(tmp_path, monkeypatch):
    """Exact numerics over the engine's FP8 KV cache (EXACT_FP8): the training forward writes its keys and values
    through the same e4m3 rounding before attending, so its logprobs are the sampler's bits, in micro-batches of 3.
    The check's teeth: the trainer over keys and values in the forward's dtype (EXACT) differs."""
    model = exact_model(tmp_path, monkeypatch, "qwen3")
    config = EngineConfig(block_size=16, numerics=EXACT, kv_cache_dtype="fp8")
    assert config.numerics is Numerics.EXACT_FP8
    out = LLMEngine(model, config).generate(PROMPTS_, SAMPLING)
    ids, mask, sampler, real = padded_batch(out)
    trainer = trainer_logprobs(model, ids, mask, real.shape[1], 3, numerics=Numerics.EXACT_FP8)
    assert torch.equal(trainer[real], sampler[real]), (trainer - sampler)[real].abs().max()
    unrounded = trainer_logprobs(model, ids, mask, real.shape[1], len(ids))
    assert (unrounded - sampler)[real].abs().max() > 1e-4


@pytest.mark.slow
def test_a_hybrids_preempted_sequences_keep_the_logprobs_bit_for_bit(tmp_path, monkeypatch):
    """Gated DeltaNet beside full attention, a pool of 16 blocks for 12 sequences: preempted sequences give their
    blocks and state slots back and are recomputed from their tokens, and every sampled logprob is still the
    training forward's."""
    model = exact_model(tmp_path, monkeypatch, "qwen3_5_text")
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=20, max_num_seqs=6, num_blocks=16,
                                           numerics=EXACT))
    out = engine.generate([p for p in PROMPTS_ for _ in range(2)],
                          SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=[EOS], seed=1))
    assert engine.stats["preemptions"] > 0
    ids, mask, sampler, real = padded_batch(out)
    trainer = trainer_logprobs(model, ids, mask, real.shape[1], 5, temperature=1.0)
    assert real.sum() > 60 and torch.equal(trainer[real], sampler[real]), (trainer - sampler)[real].abs().max()


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3_text", "qwen3_5_text"])
def test_exact_attention_gradients_match_packed_attention(tmp_path, monkeypatch, family):
    """The exact forward's backward (recomputed with PyTorch) is PackedAttention's gradient."""
    model = exact_model(tmp_path, monkeypatch, family)
    ids = torch.tensor([[3, 9, 4, 17, 5, 22, 8, 1, 2, 30]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    grads = []
    for numerics in (EXACT, Numerics.FAST):
        model.zero_grad()
        logps, _ = completion_logprobs(model, ids, mask, 5, packed=True, numerics=numerics)
        logps.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for exact, plain in zip(*grads):
        assert torch.allclose(exact, plain, atol=1e-5, rtol=1e-4)


def counted(calls: dict, name: str, real):
    def count(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)
    return count


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_checkpointed_layers_recompute_with_the_fast_kernels(tmp_path, monkeypatch, family):
    """Under gradient checkpointing the first forward is exact (the logprobs bit for bit those without it), and
    the recompute, whose values only the backward reads, runs PyTorch's attention and the vendor's GEMM
    (rlcu.kernels._recompute): no paged attention and no batch-invariant GEMM past the LM head's in the backward,
    and the gradients those without checkpointing. An MoE layer recomputes exactly as it ran, since its routing
    (the shapes of its saved tensors) could otherwise differ from the first forward's."""
    import rlcu.models.exact_attention as exact_attention

    model = exact_model(tmp_path, monkeypatch, family)
    ids = torch.tensor([[3, 9, 4, 17, 5, 22, 8, 1, 2, 30], [0, 0, 0, 7, 12, 6, 19, 3, 8, 2]])
    mask = (ids > 0).long()
    calls = {"attention": 0, "gemm": 0}
    paged = exact_attention.paged_attention
    monkeypatch.setattr(exact_attention, "paged_attention", counted(calls, "attention", paged))
    monkeypatch.setattr(matmul, "linear_triton", counted(calls, "gemm", matmul.linear_triton))
    runs = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        logps, _ = completion_logprobs(model, ids, mask, 5, packed=True, numerics=EXACT)
        forward = dict(calls)
        logps.sum().backward()
        backward = {k: calls[k] - forward[k] for k in calls}
        calls.update(attention=0, gemm=0)
        runs.append((logps.detach(), [p.grad.clone() for p in model.parameters()], forward, backward))
    (plain, plain_grads, forward, backward), (checkpointed, grads, ck_forward, ck_backward) = runs
    assert torch.equal(checkpointed, plain)
    for got, want in zip(grads, plain_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    layers, moe = model.config.num_hidden_layers, sum(layer.moe for layer in model.model.layers)
    assert ck_forward == forward and forward["attention"] == layers and backward["attention"] == 0
    assert ck_backward["attention"] == moe and (moe > 0) == (family == "qwen3_moe")  # its tiny model: 1 of 2
    assert (ck_backward["gemm"] > backward["gemm"]) if moe else (ck_backward["gemm"] == backward["gemm"] > 0)


@pytest.mark.parametrize("config", ["chunks-of-7-decode-by-3", "whole-prompts"])
def test_lora_adapters_keep_the_logprobs_bit_for_bit(tmp_path, monkeypatch, config):
    """LoRA in exact mode: A's GEMM, then the base GEMM with B's update (block-diagonal over q/k/v, gate/up) in the
    same batch-invariant launch, the same computation in the engine's decode and prefill and in training (with
    gradients recorded); micro-batches of all rows and of 3. The adapters are trained-looking (B not zero), so they
    change the logprobs."""
    from rlcu.models import add_lora
    from rlcu.models.lora import adapters

    model = exact_model(tmp_path, monkeypatch, "qwen3")
    # that the adapters change the logprobs, once: the engine in small chunks is the interpreter's slowest run
    out_base = LLMEngine(model, CONFIGS[config]).generate(PROMPTS_, SAMPLING) if config == "whole-prompts" else None
    add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in adapters(model):
            m.lora.lora_B.copy_(0.2 * torch.randn(m.lora.lora_B.shape, generator=g))
    model.check_numerics(EXACT)
    out = LLMEngine(model, CONFIGS[config]).generate(PROMPTS_, SAMPLING)
    assert out_base is None or out.logprobs != out_base.logprobs
    ids, mask, sampler, real = padded_batch(out)
    for micro_batch in (len(ids), 3):
        with torch.enable_grad():  # training's forward records gradients
            trainer = trainer_logprobs(model, ids, mask, real.shape[1], micro_batch)
        assert trainer.requires_grad
        assert torch.equal(trainer.detach()[real], sampler[real]), (trainer.detach() - sampler)[real].abs().max()


def test_lora_dropout_in_exact_mode_is_refused_in_one_line(tmp_path, monkeypatch):
    from rlcu.models import add_lora

    model = exact_model(tmp_path, monkeypatch, "qwen3")
    add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.1})
    with pytest.raises(ValueError, match="lora_dropout > 0"):
        model.check_numerics(EXACT)


def test_q_k_norms_go_into_the_rope_kernel_on_both_sides(tmp_path, monkeypatch):
    """Qwen3's per-head q/k norms: exact mode applies them inside the RoPE + KV-write kernel in the engine and in the
    training forward alike (no RMSNorm launch over a head's width on either side); the bitwise tests above fail if
    only one side does. The gradients of the norms' weights come from the backward's PyTorch recompute."""
    import rlcu.models.decoder as decoder

    model = exact_model(tmp_path, monkeypatch, "qwen3")
    widths, real_norm = [], decoder.rms_norm
    monkeypatch.setattr(decoder, "rms_norm", lambda x, *a, **kw: widths.append(x.shape[-1]) or real_norm(x, *a, **kw))
    out = LLMEngine(model, CONFIGS["whole-prompts"]).generate(PROMPTS_[:2], SAMPLING)
    ids, mask, _, real = padded_batch(out)
    with torch.enable_grad():
        trainer = trainer_logprobs(model, ids, mask, real.shape[1], len(ids))
    assert widths and model.config.head_dim not in widths, widths
    trainer[real].sum().backward()
    for layer in model.model.layers:
        assert layer.self_attn.q_norm.weight.grad.abs().sum() > 0 and layer.self_attn.k_norm.weight.grad.abs().sum() > 0
