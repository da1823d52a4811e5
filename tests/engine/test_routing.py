"""The engine's routing record: for each completion token, the experts every MoE layer picked at the position
whose output gave that token's logprob, kept slot by slot beside the KV however the engine batched the work
(prefill chunks, decode steps, forks sharing their prompt's blocks, preemption). Checked against the routing
of the training forward over the finished sequences (fp32 on the CPU: the same sets)."""
import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.kernels.moe_dispatch import route_reference as route
from rlcu.models import load_model
from rlcu.models.moe import SparseMoE
from rlcu.rollout import SamplingParams
from tests.helpers import EOS, PROMPTS, tiny_hf_folder

PROMPTS_ = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[7], PROMPTS[2]]  # the repeated one forks
SAMPLING = SamplingParams(max_tokens=9, temperature=1.0, stop_token_ids=[EOS], seed=3)


def training_routing(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[C, MoE layers, k] of the training forward, at the positions that predict each completion token."""
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in moe:
        m.keep_router_logits = True
    with torch.enable_grad():  # as training runs it: routers keep their logits only in forwards that record gradients
        model.forward_padded(torch.tensor([prompt + completion], device=next(model.parameters()).device), None)
    picked = [route(m.router_logits, m.top_k, m.normalize)[1] for m in sorted(moe, key=lambda m: m.moe_index)]
    for m in moe:
        m.keep_router_logits, m.router_logits = False, None
    start = len(prompt) - 1
    return torch.stack(picked, 1)[start:start + len(completion)].cpu()


@pytest.mark.parametrize("family,config", [
    ("qwen3_moe-unnormalised", EngineConfig(block_size=4, max_num_batched_tokens=7, max_num_seqs=3)),
    ("qwen2_moe", EngineConfig(block_size=16)),  # a dense layer among the MoE ones; whole prompts
    ("qwen3_moe", EngineConfig(block_size=4, num_blocks=12, max_num_seqs=8)),  # a pool that preempts
])
def test_the_routing_record_is_the_training_forwards_routing(tmp_path, family, config):
    model, _ = load_model(tiny_hf_folder(tmp_path, family, hidden=64, heads=4, kv_heads=2, head_dim=16))
    engine = LLMEngine(model, config)
    out = engine.generate(PROMPTS_, SAMPLING)
    layers = len(model.config.moe_layers)
    assert out.routing is not None and sum(len(c) for c in out.completion_ids) > 40
    if config.num_blocks:
        assert engine.stats["preemptions"] > 0
    with torch.no_grad():
        for p, c, r in zip(out.prompt_ids, out.completion_ids, out.routing):
            assert r.shape == (len(c), layers, 3) and r.dtype == torch.int16
            assert torch.equal(r.sort(-1).values, training_routing(model, p, c).sort(-1).values.to(torch.int16))


def test_a_dense_model_records_no_routing(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    assert LLMEngine(model, EngineConfig(block_size=4)).generate(PROMPTS_[:2], SAMPLING).routing is None
