"""The mixture-of-experts pieces (`rlcu/models/moe.py`) against transformers' own Qwen3-MoE modules and float64;
whole models (logits, engine, LoRA, export) are in test_families.py and test_llama.py."""
import pytest
import torch
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

from rlcu.kernels.moe_dispatch import route_reference as route
from rlcu.models import load_model
from rlcu.models.moe import Experts, grouped_linear, load_balancing_loss
from tests.helpers import tiny_hf_folder


def per_expert(x, weight, groups):
    """The plain loop: each row times its group's weight, in float64."""
    return torch.stack([x[i].double() @ weight[g].double().T for i, g in enumerate(groups)])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 0, 2, 7], [18, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 18],
                                    [1, 1, 1, 1, 1, 1, 12]], ids=["uneven", "all-on-first", "all-on-last", "one-each"])
def test_grouped_linear_equals_a_loop_over_experts_and_float64(counts):
    """Odd sizes (K 37, N 29), empty experts, every row on one expert."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(counts), 37, generator=g), torch.randn(len(counts), 29, 37, generator=g)
    groups = [e for e, n in enumerate(counts) for _ in range(n)]
    got = grouped_linear(x, w, torch.tensor(counts))
    assert got.shape == (18, 29)
    assert torch.allclose(got.double(), per_expert(x, w, groups), atol=1e-5)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "sampler-kernels"])
def test_experts_equal_transformers_experts_and_float64(monkeypatch, kernels):
    """`kernels`: the sampler's forward with Triton: the dispatch and combine kernels and the grouped kernel, where
    the trainer's takes torch's ops."""
    if kernels:
        monkeypatch.setenv("RLCU_TRITON", "1")
    cfg = transformers.Qwen3MoeConfig(hidden_size=40, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    theirs = hf_moe.Qwen3MoeExperts(cfg)
    torch.nn.init.normal_(theirs.gate_up_proj, std=0.2)
    torch.nn.init.normal_(theirs.down_proj, std=0.2)
    ours = Experts(6, 40, 24, "silu")
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(11, 40)
    experts = torch.tensor([[e % 6, (e + 2) % 6] for e in range(11)])
    experts[:4] = torch.tensor([5, 0])  # expert 5 crowded, 0 too; none is empty by chance
    weights = torch.rand(11, 2)
    with torch.set_grad_enabled(not kernels):
        got = ours(x, experts, weights, sampler=kernels)
    assert (got - theirs(x, experts, weights)).abs().max() < 1e-5
    x64 = x.double()
    want = torch.zeros(11, 40, dtype=torch.float64)
    for t in range(11):
        for j in range(2):
            e = experts[t, j]
            gate, up = (x64[t] @ ours.gate_up_proj[e].double().T).chunk(2)
            want[t] += weights[t, j].double() * (torch.nn.functional.silu(gate) * up) @ ours.down_proj[e].double().T
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_equals_transformers_router(normalize):
    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize)
    router = hf_moe.Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 16)
    logits, their_weights, their_experts = router(x)
    weights, experts = route(logits, 3, normalize)
    assert torch.equal(experts, their_experts) and torch.allclose(weights, their_weights, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    g = torch.Generator().manual_seed(2)
    layers = [torch.randn(2 * 7, 8, generator=g) for _ in range(3)]  # 2 rows of 7 tokens, 8 experts, 3 layers
    mask = torch.ones(2, 7, dtype=torch.long)
    if masked:
        mask[0, :3] = 0  # left padding
    want = hf_moe.load_balancing_loss_func(tuple(layers), 8, 3, mask if masked else None)
    got = load_balancing_loss(layers, 3, mask.reshape(-1).bool() if masked else None)
    assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_a_checkpoint_missing_an_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_hf_folder(tmp_path, "qwen3_moe")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        load_model(folder)


def test_moe_config_is_read_and_checked(tmp_path):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3_moe", layers=3))
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 3, 24, True)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]  # mlp_only_layers=[1]
    assert cfg.router_aux_loss_coef == transformers.Qwen3MoeConfig().router_aux_loss_coef
    from rlcu.models.config import ModelConfig

    bad = dict(cfg.source, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in 1..8"):
        ModelConfig.from_hf(bad)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "sampler-kernels"])
def test_gpt_oss_experts_equal_transformers_and_float64(monkeypatch, kernels):
    """Biases, the clamped SwiGLU (a limit that clamps here) and the checkpoint's interleaved, transposed layout
    (converted by the family's weight map) against transformers' GptOssExperts; `kernels` as for Qwen3-MoE."""
    if kernels:
        monkeypatch.setenv("RLCU_TRITON", "1")
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

    from rlcu.models.families.gpt_oss import _load

    cfg = transformers.GptOssConfig(hidden_size=40, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
                                    swiglu_limit=0.5)
    torch.manual_seed(0)
    theirs = hf_oss.GptOssExperts(cfg)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    state = _load({f"mlp.experts.{k}": v for k, v in theirs.state_dict().items()}, None)
    ours = Experts(6, 40, 24, "clamped_swiglu", bias=True, swiglu=(cfg.swiglu_alpha, 0.5))
    ours.load_state_dict({k.removeprefix("mlp.experts."): v for k, v in state.items()})
    x = 3 * torch.randn(11, 40)
    experts = torch.tensor([[e % 6, (e + 2) % 6] for e in range(11)])
    experts[:4] = torch.tensor([5, 0])
    weights = torch.rand(11, 2)
    with torch.set_grad_enabled(not kernels):
        got = ours(x, experts, weights, sampler=kernels)
    assert (got - theirs(x, experts, weights)).abs().max() < 1e-5
    x64, want, clamped = x.double(), torch.zeros(11, 40, dtype=torch.float64), 0
    for t in range(11):
        for j in range(2):
            e = experts[t, j]
            gate_up = x64[t] @ ours.gate_up_proj[e].double().T + ours.gate_up_proj_bias[e].double()
            gate, up = gate_up.chunk(2)
            clamped += int((gate > 0.5).sum() + (up.abs() > 0.5).sum())
            gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
            h = (up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)
            want[t] += weights[t, j].double() * (h @ ours.down_proj[e].double().T + ours.down_proj_bias[e].double())
    assert clamped > 0 and (got.double() - want).abs().max() < 1e-5


def test_gpt_oss_routing_equals_transformers_router():
    """Softmax over the top-k logits (gpt-oss) is the renormalised top-k of the softmax."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

    router = hf_oss.GptOssTopKRouter(transformers.GptOssConfig(hidden_size=16, num_local_experts=8,
                                                                num_experts_per_tok=3))
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    logits, their_weights, their_experts = router(torch.randn(9, 16))
    weights, experts = route(logits, 3, normalize=True)
    assert torch.equal(experts, their_experts) and torch.allclose(weights, their_weights, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_gpt_oss_transformers(masked):
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(2 * 7, 8, generator=g) for _ in range(2)]
    mask = torch.ones(2, 7, dtype=torch.long)
    if masked:
        mask[1, 5:] = 0
    want = hf_oss.load_balancing_loss_func(tuple(layers), 8, 4, mask if masked else None)
    assert torch.allclose(load_balancing_loss(layers, 4, mask.reshape(-1).bool() if masked else None), want, atol=1e-6)


def test_mxfp4_dequantisation_equals_transformers_and_the_definition():
    """Every e2m1 code and scales from 2^-127 to 2^8 (bf16 holds them), against transformers' converter and
    value = e2m1(code) * 2^(scale - 127) written out."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from rlcu.models.mxfp4 import E2M1, dequantize, dequantize_experts

    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=g, dtype=torch.uint8)  # [E, N, G, 16]: K = 64
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, both nibbles
    scales = torch.randint(100, 136, (3, 5, 2), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 127])
    got = dequantize(blocks, scales)
    assert got.shape == (3, 5, 64) and got.dtype == torch.bfloat16
    b = blocks.long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)  # [E, N, G, 32]
    want = torch.tensor(E2M1, dtype=torch.float64)[codes] * 2.0 ** (scales.double() - 127)[..., None]
    assert torch.equal(got.double(), want.flatten(-2).to(torch.bfloat16).double())
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, K, N]
    state = dequantize_experts({"x.gate_up_proj_blocks": blocks, "x.gate_up_proj_scales": scales, "x.bias": got})
    assert set(state) == {"x.gate_up_proj", "x.bias"} and torch.equal(state["x.gate_up_proj"], theirs)
    with pytest.raises(ValueError, match="x.down_proj_blocks has no x.down_proj_scales"):
        dequantize_experts({"x.down_proj_blocks": blocks})
    with pytest.raises(ValueError, match="do not pair"):
        dequantize(blocks, scales[..., :1])


def test_an_mxfp4_gpt_oss_folder_loads_as_transformers_dequantises_it(tmp_path):
    """A folder as gpt-oss ships (experts as `_blocks` / `_scales`, `quantization_config` mxfp4): rlcu's model
    equals transformers' own dequantised one, and its export is unquantised (no quantization_config)."""
    import json

    from safetensors.torch import load_file, save_file

    from rlcu.models.loading import save_pretrained

    folder = tiny_hf_folder(tmp_path, "gpt_oss", hidden=64, head_dim=16, intermediate_size=32)
    state = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k_in, n_out = state.pop(key).shape
        state[key + "_blocks"] = torch.randint(0, 256, (e, n_out, k_in // 32, 16), generator=g, dtype=torch.uint8)
        state[key + "_scales"] = torch.randint(120, 126, (e, n_out, k_in // 32), generator=g, dtype=torch.uint8)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    ours, tok = load_model(folder)
    # dequantised by transformers' own code, whether or not the `kernels` package (hub kernels) is installed
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        assert (ours.logits(ids) - theirs(input_ids=ids).logits.float()).abs().max() < 1e-5
    out = save_pretrained(ours, tok, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert (ours.logits(ids) - again(input_ids=ids).logits).abs().max() < 1e-5


def test_the_trainers_forwards_take_torchs_grouped_gemm_and_the_samplers_the_kernel(monkeypatch):
    """Under autocast (fp32 parameters, bf16 compute: Lightning's bf16-mixed) the trainer's forwards, with gradients
    (differentiable: both projections get them) or without (recomputed old logprobs: the same rounding), take
    torch's grouped GEMM; the sampler's forward with a decode step's few rows an expert takes the Triton kernel,
    and one of many rows torch's. The CPU runs torch's grouped GEMM here, as a Hopper GPU does."""
    import rlcu.models.moe as moe

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped GEMM")
    monkeypatch.setenv("RLCU_TRITON", "1")
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype: dtype == torch.bfloat16)
    taken = []
    kernel = moe.grouped_linear_triton
    monkeypatch.setattr(moe, "grouped_linear_triton", lambda *a, **k: taken.append("kernel") or kernel(*a, **k))
    torch.manual_seed(0)
    experts = Experts(4, 32, 16, "silu")
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x, picks, w = torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = experts(x, picks, w)
        trained.float().sum().backward()
        with torch.no_grad():
            assert torch.equal(experts(x, picks, w), trained) and not taken
            experts(x, picks, w, sampler=True)
            assert taken == ["kernel", "kernel"]
            many = torch.randint(0, 4, (40, 2))
            experts(torch.randn(40, 32), many, torch.rand(40, 2), sampler=True)  # 20 rows an expert
            assert taken == ["kernel", "kernel"]
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0


def test_only_the_engines_forwards_route_through_the_router_kernel(monkeypatch, tmp_path):
    """The engine's forwards hand SparseMoE a recorder; they alone take the router kernel in the default mode. The
    trainer's forwards, with gradients or without, route with PyTorch's ops, alike."""
    import rlcu.kernels.moe_dispatch as md
    import rlcu.models.moe as moe

    monkeypatch.setenv("RLCU_TRITON", "1")
    calls = []
    kernel = md.route
    monkeypatch.setattr(moe, "route", lambda *a: calls.append("kernel") or kernel(*a))
    model = load_model(tiny_hf_folder(tmp_path, "qwen3_moe", vocab_size=64, hidden=32, layers=2, heads=2,
                                      kv_heads=1, head_dim=16))[0]
    layer = next(m for m in model.modules() if isinstance(m, moe.SparseMoE))
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        plain = layer(x)
        assert not calls
        recorded = []
        sampled = layer(x, record=lambda i, e: recorded.append(e))
        assert calls == ["kernel"] and len(recorded) == 1
    assert torch.allclose(sampled, plain, atol=1e-5) and torch.equal(layer(x), plain)
