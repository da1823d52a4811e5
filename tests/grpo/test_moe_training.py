"""GRPO on a mixture-of-experts policy: the load-balancing loss (TRL's router_aux_loss_coef), the routing metrics,
and a clear error where there is no router."""
import pytest
import torch

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from rlcu.models.moe import SparseMoE, load_balancing_loss
from tests.helpers import fit, match_target, tiny_hf_folder, toy_rows


def moe_module(tmp_path, **kw):
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3_moe", layers=3))
    options = dict(rewards=[match_target], num_generations=4, max_completion_length=4, learning_rate=1e-2,
                   micro_batch_size=3)
    options.update(kw)
    return GRPOModule(model, tokenizer=tok, **options)


def test_the_load_balancing_loss_trains_the_routers_and_is_logged(tmp_path):
    torch.manual_seed(0)
    module = moe_module(tmp_path, router_aux_loss_coef=0.5)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if n.endswith("mlp.gate.weight")}
    metrics = fit(module, toy_rows(4), steps=2, log_dir=tmp_path)
    logged = [m for m in metrics if "aux_loss" in m]
    assert logged and all(m["aux_loss"] >= 1.0 - 1e-6 for m in logged)  # E * sum(f * P) >= 1, equality when balanced
    assert all(m["moe/expert_load_max"] >= 1.0 for m in logged)
    after = dict(module.policy.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_the_config_coefficient_is_the_default_and_zero_turns_it_off(tmp_path):
    module = moe_module(tmp_path)
    assert module.update_phase.routers.coef == module.policy.config.router_aux_loss_coef > 0
    off = moe_module(tmp_path / "off", router_aux_loss_coef=0.0)
    metrics = fit(off, toy_rows(4), steps=1, log_dir=tmp_path / "off")
    assert not any("aux_loss" in m for m in metrics)
    assert any("moe/expert_load_max" in m for m in metrics)  # the routing is measured either way


def test_the_loss_under_activation_checkpointing_has_the_same_gradient(tmp_path):
    """The router logits kept from a checkpointed forward carry the gradient of the recomputed one."""
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3_moe", layers=3))
    ids = torch.randint(0, 62, (2, 9))
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        for m in moe:
            m.keep_router_logits = True
        model(ids)
        load_balancing_loss([m.router_logits for m in moe], 3).backward()
        grads.append([m.gate.weight.grad.clone() for m in moe])
    for a, b in zip(*grads):
        assert a.abs().sum() > 0 and torch.allclose(a, b, atol=1e-6)


def test_router_aux_loss_coef_on_a_dense_model_is_refused(tmp_path):
    model, tok = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    with pytest.raises(ValueError, match="qwen3 is not a mixture-of-experts model .* leave router_aux_loss_coef unset"):
        GRPOModule(model, tokenizer=tok, rewards=[match_target], router_aux_loss_coef=0.01)


@pytest.mark.parametrize("packing", [False, True])
def test_routing_mismatch_compares_the_samplers_routing_with_the_trainers(tmp_path, monkeypatch, packing):
    """fp32 on the CPU: the engine and the training forward route every token alike (0.0). With the engine's
    record shifted by one expert, every compared token differs (1.0): the metric reads the record."""
    from rlcu.engine.routing import RoutingCache

    torch.manual_seed(0)
    metrics = fit(moe_module(tmp_path, packing=packing), toy_rows(4), steps=1, log_dir=tmp_path)
    assert [m["moe/routing_mismatch"] for m in metrics if "moe/routing_mismatch" in m] == [0.0]
    read = RoutingCache.read
    monkeypatch.setattr(RoutingCache, "read", lambda self, slots: (read(self, slots) + 1) % 8)
    torch.manual_seed(0)
    metrics = fit(moe_module(tmp_path / "shifted", packing=packing), toy_rows(4), steps=1, log_dir=tmp_path / "s")
    assert [m["moe/routing_mismatch"] for m in metrics if "moe/routing_mismatch" in m] == [1.0]
