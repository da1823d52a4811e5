"""Mixture of experts on the GPU: torch's grouped GEMM against float64, decode steps captured as CUDA graphs (the
dispatch never reads the counts on the host) with the routing record they write, and a bf16 training step through
the grouped GEMM's backward that logs moe/routing_mismatch."""
import pytest
import torch

from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from rlcu.models.moe import grouped_linear, grouped_mm_supported
from rlcu.rollout import SamplingParams
from tests.helpers import EOS, PROMPTS, logprob_gaps, tiny_hf_folder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and grouped_mm_supported(torch.device("cuda"),
                                                                                         torch.bfloat16)),
                                 reason="needs torch's grouped GEMM (a Hopper GPU)")]


@pytest.mark.parametrize("counts", [[3, 0, 50, 1, 0, 2, 71], [128, 0, 0, 0], [0, 0, 0, 96]])
def test_grouped_gemm_against_float64(counts):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(counts), 256, generator=g), torch.randn(len(counts), 96, 256, generator=g) / 16
    groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    want = torch.einsum("mk,mnk->mn", x.double(), w.double()[groups])
    got = grouped_linear(x.cuda().bfloat16(), w.cuda().bfloat16(), torch.tensor(counts).cuda())
    assert got.shape == want.shape and (got.double().cpu() - want).abs().max() < 0.1


@pytest.mark.parametrize("family,lora", [("qwen3_moe", False), ("gpt_oss", False), ("gpt_oss", True)])
def test_decode_runs_as_cuda_graphs_and_matches_the_training_forward(tmp_path, family, lora):
    """With `lora`: adapters on attention and on the experts, their B random, through the grouped GEMM too."""
    model = load_model(tiny_hf_folder(tmp_path, family, vocab_size=512, hidden=256, layers=3, heads=4,
                                      kv_heads=2, head_dim=64), dtype="bfloat16")[0].cuda()
    if lora:
        from rlcu.models import add_lora
        from rlcu.models.lora import expert_adapters

        add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                         "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})
        with torch.no_grad():
            for _, m in expert_adapters(model):
                for a in m.lora.values():
                    a.lora_B.normal_(std=0.05)
    engine = LLMEngine(model, EngineConfig(release_memory=False))
    out = engine.generate([p for p in PROMPTS for _ in range(4)],
                          SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[EOS], seed=0))
    assert engine.runner.graphs is not None
    gaps = logprob_gaps(model, out)
    print(f"{family} bf16 lora={lora}, graphs: engine vs trainer logprob |diff| mean {gaps.mean():.2e} "
          f"max {gaps.max():.2e}")
    assert gaps.mean() < 0.05
    # the routing record, written inside the captured graphs, against the training forward's routing
    from tests.engine.test_routing import training_routing

    with torch.no_grad():
        differs = [(r.sort(-1).values != training_routing(model, p, c).sort(-1).values).flatten(1).any(1)
                   for p, c, r in zip(out.prompt_ids, out.completion_ids, out.routing)]
    share = float(torch.cat(differs).float().mean())
    print(f"{family} bf16 lora={lora}, graphs: tokens routed elsewhere by the trainer {share:.3f}")
    assert share < 0.1


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_bf16_training_step_through_the_grouped_gemm(tmp_path, family):
    from rlcu.grpo.module import GRPOModule
    from tests.helpers import fit, toy_rows, varied_reward

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", family, vocab_size=512, hidden=256, layers=3,
                                           heads=4, kv_heads=2, head_dim=64))
    module = GRPOModule(model, tokenizer=tok, rewards=[varied_reward], num_generations=4, max_completion_length=8,
                        learning_rate=1e-3, router_aux_loss_coef=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    metrics = fit(module, toy_rows(4), steps=1, log_dir=tmp_path, accelerator="gpu", precision="bf16-mixed")
    assert any("aux_loss" in m for m in metrics)
    assert [m["moe/routing_mismatch"] < 0.1 for m in metrics if "moe/routing_mismatch" in m] == [True]
    same = [n for n, p in model.named_parameters() if n in before and torch.equal(before[n], p.detach().cpu())]
    assert not same, (same, [{k: v for k, v in m.items() if "reward" in k or "loss" in k} for m in metrics])


@pytest.mark.parametrize("tokens,k,experts", [(64, 8, 128), (512, 8, 128), (37, 4, 32)])
def test_route_dispatch_and_combine_kernels_against_their_references(tokens, k, experts):
    """The sampler's forwards take the kernels, the trainer's the references: exact mode needs the dispatch's and
    the combine's bits the same (on the GPU the compiler could fuse the combine's products into its sums; the
    launch turns that off); the default mode's router kernel picks the same experts."""
    import rlcu.kernels.moe_dispatch as md

    g = torch.Generator().manual_seed(tokens)
    logits = (3 * torch.randn(tokens, experts, generator=g)).cuda()
    (w, e), (rw, re) = md.route(logits, k, True), md.route_reference(logits, k, True)
    assert torch.equal(e, re) and (w - rw).abs().max() < 1e-6
    got, ref = md.dispatch(e, experts), md.dispatch_reference(e, experts)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    for dtype, wdtype in [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                          (torch.float32, torch.float32)]:
        y = (4 * torch.randn(tokens * k, 2048, generator=g)).to("cuda", dtype)
        w = torch.rand(tokens, k, generator=g).softmax(-1).to("cuda", wdtype)
        assert torch.equal(md.combine(y, got, w), md.combine_reference(y, got, w)), (dtype, wdtype)
