import pytest
import torch

from rlcu.grpo.logprobs import completion_logprobs, linear_logprobs
from rlcu.models import load_model
from tests.helpers import grpo_batch, tiny_hf_folder


def test_chunked_logprobs_equal_full_log_softmax_with_gradients(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen2"))
    model.double()
    ids = torch.randint(0, 62, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    c, temp = 5, 0.7
    upstream = torch.randn(3, c, dtype=torch.float64)  # any weighting of the tokens, as the loss gives
    logps, ent = completion_logprobs(model, ids, mask, c, temp, chunk_tokens=4)  # chunks cross rows
    (logps * upstream).sum().backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = torch.log_softmax(model.logits(ids, mask)[:, -c - 1:-1] / temp, -1)
    expected = full.gather(-1, ids[:, -c:, None])[..., 0]
    (expected * upstream).sum().backward()
    assert torch.allclose(logps, expected, atol=1e-12)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-12)
    assert all(torch.allclose(a, p.grad, atol=1e-12) for a, p in zip(chunked, model.parameters()))


TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # vs float64, relative to the max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_linear_logprobs_match_float64_in_low_precision(dtype, autocast, fused, softcap, monkeypatch):
    """The hand-written backward against float64 autograd, for bf16 weights and for fp32 weights under
    bf16 autocast (the bf16-mixed recipes); odd sizes, a temperature, a chunk that splits the rows.
    `fused`: the Triton statistics and gradient kernels (the CUDA path; here the interpreter, whose bf16
    arithmetic is wrong, so fp32 and fp16). `softcap`: Gemma 2's soft-capped logits, at a cap that bends them."""
    if autocast and dtype != torch.float32:
        pytest.skip("autocast runs fp32 weights in bf16")
    if fused:
        if not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON:
            pytest.skip("triton is not installed")
        if not torch.cuda.is_available() and (dtype == torch.bfloat16 or autocast):
            pytest.skip("the Triton interpreter's bf16 arithmetic is wrong")
        monkeypatch.setenv("RLCU_TRITON", "1")
    dev = "cuda" if fused and torch.cuda.is_available() else "cpu"  # the kernels on the GPU, else the interpreter
    g = torch.Generator().manual_seed(0)
    hidden64 = torch.randn(37, 24, generator=g, dtype=torch.float64)
    weight64 = torch.randn(101, 24, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(0, 101, (37,), generator=g)
    upstream = torch.randn(37, generator=g, dtype=torch.float64)
    h64, w64 = hidden64.clone().requires_grad_(), weight64.clone().requires_grad_()
    logits64 = h64 @ w64.t()
    if softcap is not None:
        logits64 = softcap * torch.tanh(logits64 / softcap)
    full = torch.log_softmax(logits64 / 0.8, -1)
    (full.gather(-1, targets[:, None])[:, 0] * upstream).sum().backward()
    h, w = hidden64.to(dev, dtype).requires_grad_(), weight64.to(dev, dtype).requires_grad_()
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        logps, ent = linear_logprobs(h, w, targets.to(dev), 0.8, chunk_tokens=10, softcap=softcap)
    (logps * upstream.to(dev, logps.dtype)).sum().backward()
    tol = TOLERANCES[torch.bfloat16 if autocast else dtype]
    assert logps.dtype == torch.float32 and h.grad.dtype == dtype and w.grad.dtype == dtype
    for ours, ref in ((logps, full.gather(-1, targets[:, None])[:, 0]), (ent, -(full.exp() * full).sum(-1)),
                      (h.grad, h64.grad), (w.grad, w64.grad)):
        err = (ours.double().cpu() - ref.detach()).abs().max() / ref.abs().max()
        assert err < tol, f"max relative error {err:.2e} over {tol:.0e}"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_logprobs_equal_padded_with_gradients(tmp_path, family):
    """Padding-free packing: prompts left-padded and completions right-padded to different lengths run as
    one sequence; the real completion tokens' logprobs, entropies and the gradients they give match the
    padded forward's, and padded slots are 0."""
    model, _ = load_model(tiny_hf_folder(tmp_path, family))
    model.double()
    ids, mask, c = grpo_batch([3, 7, 1, 5], [4, 1, 6, 2], seed=1)
    real = mask[:, -c:].bool()
    upstream = torch.randn(4, c, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * real
    results, grads = [], []
    for packed in (False, True):
        model.zero_grad()
        logps, ent = completion_logprobs(model, ids, mask, c, 0.8, chunk_tokens=3, packed=packed)
        (logps * upstream).sum().backward()
        results.append((logps.detach(), ent))
        grads.append([q.grad.clone() for q in model.parameters()])
    (padded_lp, padded_ent), (packed_lp, packed_ent) = results
    assert torch.allclose(packed_lp[real], padded_lp[real], atol=1e-10)
    assert torch.allclose(packed_ent[real], padded_ent[real], atol=1e-10)
    assert not packed_lp[~real].any() and not packed_ent[~real].any()
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(*grads))


def test_cast_lm_head_to_fp32_computes_the_head_in_float32_beside_bf16_weights(tmp_path):
    """TRL's cast_lm_head_to_fp32: the head's weight and its input in float32, autocast off. On bf16 weights, the
    training logprobs then equal a float64 head on the same hidden states to float32's precision, where the bf16
    head carries bf16's rounding; the head's gradient arrives in float32; the rest of the model stays bf16."""
    folder = tiny_hf_folder(tmp_path, "qwen3", tie_word_embeddings=False, vocab_size=96)
    plain, _ = load_model(folder, dtype="bfloat16")
    cast, _ = load_model(folder, dtype="bfloat16")
    cast.cast_lm_head_to_fp32()
    assert cast.lm_head.weight.dtype == torch.float32 and cast.model.norm.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 94, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    c, temp = 6, 0.9
    hidden = cast.forward_padded(ids, mask)[:, -c - 1:-1].double()
    full = torch.log_softmax(hidden @ cast.lm_head.weight.double().T / temp, -1)
    reference = full.gather(-1, ids[:, -c:, None])[..., 0]
    got = completion_logprobs(cast, ids, mask, c, temp)[0]
    bf16 = completion_logprobs(plain, ids, mask, c, temp)[0]
    assert got.dtype == torch.float32 and (got.double() - reference).abs().max() < 1e-5
    assert (bf16.double() - reference).abs().max() > 1e-4  # what the cast removes
    got.sum().backward()
    assert cast.lm_head.weight.grad.dtype == torch.float32 and cast.model.norm.weight.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the engine's head, under a mixed precision's autocast
        logits = cast.lm_head(hidden[0].to(torch.bfloat16))
    assert logits.dtype == torch.float32
    tied, _ = load_model(tiny_hf_folder(tmp_path / "tied", "qwen3", tie_word_embeddings=True), dtype="bfloat16")
    with pytest.raises(ValueError, match="tied to the embeddings"):
        tied.cast_lm_head_to_fp32()
