"""The reference rollout against transformers' generate, and against the trainer's logprobs."""

import pytest
import torch
import transformers

from rlcu.grpo.logprobs import completion_logprobs
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from rlcu.rollout.reference import ReferenceRollout
from tests.helpers import tiny_hf_folder

PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 3, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]


def backend(model, **kw):
    b = ReferenceRollout(**kw)
    b.setup(model, None)
    return b


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tmp_path, family):
    folder = tiny_hf_folder(tmp_path, family)
    model, _ = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = 63
    out = backend(model, max_batch_size=3).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                           stop_token_ids=[eos]))
    for prompt, got, reason in zip(PROMPTS, out.completion_ids, out.finish_reasons):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                          pad_token_id=62)[0, len(prompt):].tolist()
        if eos in ref:
            ref = ref[:ref.index(eos) + 1]
        assert got == ref
        assert reason == ("stop" if got[-1] == eos else "length")


def test_sampled_logprobs_match_the_training_forward(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen2"))
    sp = SamplingParams(max_tokens=9, temperature=0.8, top_k=20, stop_token_ids=[63], seed=1)
    out = backend(model).generate(PROMPTS, sp)
    worst = 0.0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])
        ref, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(c), sp.temperature)
        worst = max(worst, (ref[0] - torch.tensor(lp)).abs().max().item())
    assert worst < 1e-4, f"max |sampler - trainer| logprob = {worst}"


def test_seeded_sampling_is_reproducible_and_lengths_are_bounded(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    sp = SamplingParams(max_tokens=7, stop_token_ids=[63], seed=5)
    a, b = backend(model).generate(PROMPTS, sp), backend(model, max_batch_size=2).generate(PROMPTS, sp)
    assert all(1 <= len(c) <= 7 for c in a.completion_ids)
    assert a.prompt_ids == PROMPTS
    assert a.completion_ids == backend(model).generate(PROMPTS, sp).completion_ids
    assert len(b) == len(a)


def test_bad_requests_are_named(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "llama"))
    with pytest.raises(ValueError, match="at least one token"):
        backend(model).generate([[1], []], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before setup"):
        ReferenceRollout().generate([[1]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
