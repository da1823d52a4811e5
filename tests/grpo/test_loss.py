"""The GRPO maths against values computed by hand from the published definitions (and TRL's code)."""
import math

import pytest
import torch

from rlcu.grpo import loss as L

nan = float("nan")


def test_group_advantages_scale_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, std, zero = L.group_advantages(r, 4, "group")
    s = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    expected = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0, 0, 0, 0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert zero.tolist() == [False] * 4 + [True] * 4
    assert std[0] == pytest.approx(s, abs=1e-6)


def test_group_advantages_scale_batch_and_none():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, _, _ = L.group_advantages(r, 4, "batch")
    s = math.sqrt(5.5 / 7)  # unbiased std over the 8 rewards (mean 1.25)
    assert adv[0].item() == pytest.approx(0.5 / (s + 1e-4), abs=1e-6)
    assert adv[4].item() == 0.0
    adv, _, zero = L.group_advantages(r, 4, "none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    assert zero[4] and not zero[0]  # zero-std detection does not depend on the scale


def test_unscorable_rows_leave_the_baseline_and_get_zero_advantage():
    r = L.combine_rewards(torch.tensor([[nan, nan], [1.0, nan], [0.0, 2.0], [nan, 1.0]]), torch.tensor([1.0, 0.5]))
    assert math.isnan(r[0]) and r[1:].tolist() == [1.0, 1.0, 0.5]
    adv, _, _ = L.group_advantages(r, 4, "none")
    assert adv[0] == 0.0
    assert adv[1:].tolist() == pytest.approx([1 - 2.5 / 3, 1 - 2.5 / 3, 0.5 - 2.5 / 3])


def test_clipped_surrogate_per_token():
    logps, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -1.5]])
    mask = torch.ones(1, 2)
    r1, r2 = math.exp(0.1), math.exp(-0.5)
    loss, coef, kl = L.per_token_loss(logps, old, torch.tensor([2.0]), mask, 0.2, 0.2)
    assert kl is None
    assert loss[0].tolist() == pytest.approx([-2 * r1, -2 * r2], abs=1e-6)  # r2 < 0.8 but A > 0: unclipped
    loss, coef, _ = L.per_token_loss(logps, old, torch.tensor([-2.0]), mask, 0.2, 0.2)
    assert loss[0].tolist() == pytest.approx([2 * r1, 2 * 0.8], abs=1e-6)  # A < 0: ratio clipped at 1 - eps
    low, high, region = L.clip_masks(coef, torch.tensor([-2.0]), 0.2, 0.2)
    assert low.tolist() == [[False, True]] and not high.any() and region.tolist() == low.tolist()


def test_clip_higher_uses_epsilon_high():
    logps, old = torch.tensor([[0.0]]), torch.tensor([[-0.25]])  # ratio e^0.25 = 1.284
    loss, coef, _ = L.per_token_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)
    loss, _, _ = L.per_token_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)


def test_gspo_sequence_level_ratio():
    logps, old = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.1, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the masked token must not enter the sequence ratio
    loss, coef, _ = L.per_token_loss(logps, old, torch.tensor([2.0]), mask, 0.2, 0.2, level="sequence")
    w = math.exp((0.1 - 0.5) / 2)
    assert coef.shape == (1, 1) and coef.item() == pytest.approx(w, abs=1e-6)
    assert loss.item() == pytest.approx(-2 * w, abs=1e-6)


def test_k3_kl_and_beta():
    logps, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert L.k3_kl(logps, ref).item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-7)
    assert L.k3_kl(logps, logps).item() == 0.0
    loss, _, kl = L.per_token_loss(logps, logps.clone(), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2,
                                   ref_logps=ref, beta=0.1)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * (math.exp(-0.5) - 0.5), abs=1e-6)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("loss_type,expected", [("grpo", (1.5 + 4) / 2), ("bnpo", 7 / 3), ("dr_grpo", 7 / (2 * 4)),
                                                ("dapo", 7 / 10)])
def test_aggregation(loss_type, expected):
    got = L.aggregate_loss(PER_TOKEN, MASK, loss_type, max_completion_length=4, num_items_in_batch=10)
    assert got.item() == pytest.approx(expected)
    halved = L.aggregate_loss(PER_TOKEN, MASK, loss_type, 4, num_micro_batches=2, num_items_in_batch=10)
    assert halved.item() == pytest.approx(expected if loss_type == "dapo" else expected / 2)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_the_full_batch_gradient(loss_type):
    torch.manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(4, 5) > 0.3).double()
    n = mask.sum()
    L.aggregate_loss(x ** 2, mask, loss_type, 5, 1, n).backward()
    full, x.grad = x.grad.clone(), None
    for rows in (slice(0, 2), slice(2, 4)):
        L.aggregate_loss(x[rows] ** 2, mask[rows], loss_type, 5, 2, n).backward()
    assert torch.allclose(full, x.grad)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        L.aggregate_loss(PER_TOKEN, MASK, "ppo", 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        L.group_advantages(torch.zeros(4), 2, "median")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        L.log_importance_weights(PER_TOKEN, PER_TOKEN, MASK, "batch")
