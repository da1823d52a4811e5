import torch

from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from tests.helpers import tiny_hf_folder


def test_chunked_logprobs_equal_full_log_softmax_with_gradients(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen2"))
    model.double()
    ids = torch.randint(0, 62, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    c, temp = 5, 0.7
    logps, ent = completion_logprobs(model, ids, mask, c, temp, chunk_tokens=4)  # chunks cross rows
    logps.sum().backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = torch.log_softmax(model.logits(ids, mask)[:, -c - 1:-1] / temp, -1)
    expected = full.gather(-1, ids[:, -c:, None])[..., 0]
    expected.sum().backward()
    assert torch.allclose(logps, expected, atol=1e-12)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-12)
    assert all(torch.allclose(a, p.grad, atol=1e-12) for a, p in zip(chunked, model.parameters()))
