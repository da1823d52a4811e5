"""Tensor parallelism (`rlcu/models/tensor_parallel.py`) on 2 CPU processes (gloo) against one process holding
the whole model: logits, the gradient of every parameter, the engine's greedy tokens and sampled logprobs,
and the state dict assembled back whole. Tolerances are float32's, summed in another order (the row-parallel
projections add two partial sums)."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcu.models import load_model
from tests.helpers import DENSE_FAMILIES, EOS, PROMPTS, tiny_hf_folder

SIZE = 2
IDS = torch.tensor([[5, 9, 2, 33, 7, 18], [40, 1, 12, 6, 3, 27]])


def _whole_model_results(folder):
    """What one process gives: logits, gradients (of a fixed loss), greedy tokens, sampled logprobs."""
    from rlcu.engine.llm_engine import LLMEngine
    from rlcu.rollout import SamplingParams

    model, _ = load_model(folder)
    logits = model.logits(IDS)
    loss = (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        greedy = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS]))
        sampled = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    return logits.detach(), grads, greedy.completion_ids, sampled


def _rank(rank, folders, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=SIZE)
    try:
        for folder in folders:
            torch.save(_split_model_results(folder), f"{out}/{Path(folder).name}.{rank}.pt")
        torch.save(_meta_built_share(folders[0]), f"{out}/meta.{rank}.pt")
        for folder in folders:
            if Path(folder).name in READ_ALONE:
                torch.save(_shares_read_alone(folder), f"{out}/{Path(folder).name}.lazy.{rank}.pt")
    finally:
        dist.destroy_process_group()
    # everything is saved: end without the interpreter's teardown, where gloo's threads have now and then aborted a
    # rank that finished (`terminate called without an active exception`; tests/integration/distributed_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _split_model_results(folder):
    """What this rank gives, its model split between the processes."""
    from rlcu.engine.llm_engine import LLMEngine
    from rlcu.models.tensor_parallel import full_state_dict, parallelize
    from rlcu.rollout import SamplingParams

    model, _ = load_model(folder)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize(model, dist.group.WORLD)
    logits = model.logits(IDS)
    loss = (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum()
    loss.backward()
    for p in model.parameters():  # each rank's gradient of its share, assembled whole like the weights
        p.data, p.grad = p.grad, None
    grads = {k: v.clone() for k, v in full_state_dict(model).items()}
    model.load_state_dict(whole)  # whole tensors back in: each rank keeps its share
    with torch.no_grad():
        greedy = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[EOS]))
        sampled = LLMEngine(model).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    return dict(logits=logits.detach(), grads=grads, greedy=greedy.completion_ids, sampled=sampled,
                state=full_state_dict(model), whole=whole, heads=model.config.num_attention_heads,
                vocab_rows=(model.lm_head.weight.shape[0], model.model.embed_tokens.weight.shape[0]))


def _shares_read_alone(folder):
    """`low_cpu_mem_usage`: the model built on the meta device, split, then its shares read from the checkpoint's
    files as slices."""
    from rlcu.models.loading import load_pending
    from rlcu.models.tensor_parallel import full_state_dict, parallelize

    model, _ = load_model(folder, low_cpu_mem_usage=True)
    assert model.model.embed_tokens.weight.device.type == "meta"
    parallelize(model, dist.group.WORLD)
    read = model.pending_weights.shares(model)  # slices of the files: each the size of the rank's parameter
    assert all(read[k].shape == v.shape for k, v in model.state_dict().items() if k in read)
    assert load_pending(model, "cpu") and not load_pending(model, "cpu")  # read once
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return dict(state=full_state_dict(model), logits=model.logits(IDS).detach(), tied=tied,
                shares={k: v.shape for k, v in model.state_dict().items()})


def _meta_built_share(folder):
    """A model built on the meta device (no memory), split, then its share given memory and random weights."""
    from rlcu.models.decoder import CausalLM
    from rlcu.models.random_init import materialize
    from rlcu.models.tensor_parallel import parallelize

    config = load_model(folder)[0].config
    with torch.device("meta"):
        model = CausalLM(config)
    parallelize(model, dist.group.WORLD)
    materialize(model, torch.device("cpu"), seed=3)
    return {k: v.clone() for k, v in model.state_dict().items()}


SPLIT_FAMILIES = ["llama", "llama-untied-bias", "qwen2", "qwen3", *DENSE_FAMILIES]  # every dense native family
# read as shares from the files: tied and untied LM heads (with biases), Phi-3's q/k/v and gate/up stored fused,
# OLMo 2's q/k norms over all heads (split by heads)
READ_ALONE = ["llama", "llama-untied-bias", "phi3", "olmo2"]


def test_two_ranks_compute_what_one_process_does_in_every_dense_family(tmp_path):
    folders = [tiny_hf_folder(tmp_path / f, f, heads=4, kv_heads=2) for f in SPLIT_FAMILIES]
    mp.start_processes(_rank, args=([str(f) for f in folders], tmp_path / "store", tmp_path), nprocs=SIZE,
                       start_method="spawn")
    for family, folder in zip(SPLIT_FAMILIES, folders):
        logits, grads, greedy, sampled = _whole_model_results(folder)
        for rank in range(SIZE):
            got = torch.load(tmp_path / f"{family}.{rank}.pt", weights_only=False)
            assert got["heads"] == 2  # the rank's config: half the heads
            assert got["vocab_rows"] == (32, 32)  # half the vocabulary's rows of the LM head and embeddings
            torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-5, msg=family)
            assert grads.keys() <= got["grads"].keys()  # (a tied LM head is one parameter, two state-dict keys)
            for k in grads:
                torch.testing.assert_close(got["grads"][k], grads[k], rtol=1e-4, atol=1e-5, msg=f"{family}: {k}")
            assert got["greedy"] == greedy, family
            assert got["sampled"].completion_ids == sampled.completion_ids, family
            for a, b in zip(got["sampled"].logprobs, sampled.logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5, msg=family)
            for k, v in got["whole"].items():  # assembled back whole, bit for bit
                assert torch.equal(got["state"][k], v), f"{family}: {k}"
        assert len({tuple(c) for c in sampled.completion_ids}) > 2, family  # not one answer for every prompt
    for family, folder in zip(SPLIT_FAMILIES, folders):  # shares read alone: the eager split's, bit for bit
        if family not in READ_ALONE:
            continue
        logits = _whole_model_results(folder)[0]
        for rank in range(SIZE):
            eager = torch.load(tmp_path / f"{family}.{rank}.pt", weights_only=False)
            lazy = torch.load(tmp_path / f"{family}.lazy.{rank}.pt", weights_only=False)
            assert lazy["tied"] == (family == "llama")
            assert all(torch.equal(lazy["state"][k], v) for k, v in eager["whole"].items()), family
            assert lazy["shares"]["model.layers.0.mlp.down_proj.weight"][1] * SIZE == \
                eager["whole"]["model.layers.0.mlp.down_proj.weight"].shape[1]
            torch.testing.assert_close(lazy["logits"], logits, rtol=0, atol=1e-5, msg=family)
    # built on the meta device: each rank's share of it materialised; the whole tensors drawn alike on every rank
    meta = [torch.load(tmp_path / f"meta.{rank}.pt") for rank in range(SIZE)]
    whole = load_model(folders[0])[0].state_dict()
    for k, v in meta[0].items():
        assert v.device.type == "cpu" and v.isfinite().all()
        if v.shape == whole[k].shape:
            assert torch.equal(v, meta[1][k]), k
        else:
            assert v.numel() * SIZE == whole[k].numel(), k
    assert meta[0]["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_a_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    from rlcu.models.tensor_parallel import parallelize

    model, _ = load_model(tiny_hf_folder(tmp_path / "m", "llama", heads=6, kv_heads=2))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's num_attention_heads"):
        parallelize(model, None, size=4, rank=0)


def test_a_mixture_of_experts_is_refused(tmp_path):
    from rlcu.models.tensor_parallel import parallelize

    model, _ = load_model(tiny_hf_folder(tmp_path / "m", "qwen3_moe"))
    with pytest.raises(ValueError, match="experts are not split across ranks.*tensor_parallel_size=1"):
        parallelize(model, None, size=2, rank=0)
