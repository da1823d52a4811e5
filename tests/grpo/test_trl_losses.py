"""Every loss type against TRL 1.16's own `GRPOTrainer._compute_loss`, run on the same float64 tensors (TRL's
method with a stand-in for the trainer around it: no model, one process): the loss and its gradient with
respect to the logprobs, with masks, a KL term, two-sided clipping, the top-entropy mask and the entropy bonus.
Also the advantage estimators against their papers' formulas, written out."""
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlcu.grpo import loss as L

trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
B, T, G = 6, 7, 3


class OneProcess:
    """What TRL's loss asks of accelerate, for a single process."""
    num_processes, sync_gradients = 1, True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(tensors, loss_type, level="token", beta=0.0, delta=None, quantile=1.0, entropy_coef=0.0,
             epsilon=0.2, epsilon_high=0.28, num_micro_batches=1, correction=None, threshold=None):
    logps, old, ref, adv, mask, entropies = tensors
    args = SimpleNamespace(delta=delta, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                           vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=True,
                           steps_per_generation=num_micro_batches, entropy_target=0.2)
    trainer = SimpleNamespace(
        args=args, loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon_high, top_entropy_quantile=quantile, off_policy_mask_threshold=threshold,
        use_vllm=correction is not None or threshold is not None,
        vllm_importance_sampling_correction=correction is not None,
        current_gradient_accumulation_steps=num_micro_batches,
        get_off_policy_mask=trl_trainer.GRPOTrainer.get_off_policy_mask,
        max_completion_length=T + 3, accelerator=OneProcess(), model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)}, aux_loss_enabled=False, entropy_coef=entropy_coef,
        use_adaptive_entropy=False, _entropy_bonus_enabled=entropy_coef != 0.0,
        get_gamma_weights=trl_trainer.GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None))
    trainer.get_high_entropy_mask = lambda e, m, t: trl_trainer.GRPOTrainer.get_high_entropy_mask(trainer, e, m, t)
    inputs = dict(prompt_ids=torch.zeros(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask.long(), advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum(),
                  sampling_per_token_logps=sampler_logps(tensors))
    if correction is not None:
        inputs["importance_sampling_ratio"] = trl_ratio(old, inputs["sampling_per_token_logps"], mask, *correction)
    return trl_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)


def sampler_logps(tensors):
    """The sampler's logprobs: the old policy's, off by up to 0.4 nats, one of them unknown (NaN)."""
    old = tensors[1]
    g = torch.Generator().manual_seed(7)
    sampler = old + 0.4 * (torch.rand(old.shape, generator=g, dtype=old.dtype) - 0.5)
    sampler[0, 1] = float("nan")
    return sampler


def trl_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's importance-sampling ratio (GRPOTrainer._generate_and_score_completions), element by element."""
    rows = []
    for i in range(old.shape[0]):
        diffs = [0.0 if math.isnan(float((old[i, t] - sampler[i, t]) * mask[i, t])) else
                 float((old[i, t] - sampler[i, t]) * mask[i, t]) for t in range(old.shape[1])]
        values = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        if mode.endswith("truncate"):
            values = [min(max(v, low), high) for v in values]
        else:
            values = [0.0 if v < low or v > high else v for v in values]
        rows.append(values)
    return torch.tensor(rows, dtype=old.dtype)


def ours(tensors, loss_type, level="token", beta=0.0, delta=None, quantile=1.0, entropy_coef=0.0, epsilon=0.2,
         epsilon_high=0.28, correction=None, threshold=None):
    logps, old, ref, adv, mask, entropies = tensors
    token_mask = L.high_entropy_mask(entropies, mask, quantile) if quantile < 1.0 else None
    sampler = sampler_logps(tensors)
    ratio = L.sampling_ratio(old, sampler, mask, *correction) if correction is not None else None
    keep = L.off_policy_mask(adv, logps, sampler, mask, threshold) if threshold is not None else None
    ptl, _, _ = L.per_token_loss(logps, old, adv, mask, epsilon, epsilon_high, level, ref, beta, loss_type,
                                 L.LossOptions(delta=delta), token_mask, ratio, keep)
    loss = L.aggregate_loss(ptl, mask, loss_type, T + 3, 1, mask.sum())
    if entropy_coef:
        effective = mask if token_mask is None else mask * token_mask
        loss = loss - entropy_coef * L.entropy_bonus(entropies, effective)
    return loss


def random_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logps = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    mask[:, 0] = 1
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    return logps, old, ref, adv, mask, entropies


CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=0.5), "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", level="sequence"), "vespo": dict(loss_type="vespo"),
    "grpo": dict(loss_type="grpo"), "bnpo": dict(loss_type="bnpo"), "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"), "gspo": dict(loss_type="grpo", level="sequence"),
    "dapo+kl": dict(loss_type="dapo", beta=0.04), "sapo+kl": dict(loss_type="sapo", beta=0.1),
    "two-sided clip": dict(loss_type="grpo", delta=1.1),
    "top-entropy tokens": dict(loss_type="dapo", quantile=0.3),
    "entropy bonus": dict(loss_type="bnpo", entropy_coef=0.01),
    "entropy bonus on top tokens": dict(loss_type="vespo", quantile=0.5, entropy_coef=0.02),
    "sequence_mask correction": dict(loss_type="dapo", correction=("sequence_mask", None, 3.0)),
    "sequence_mask, tight": dict(loss_type="grpo", correction=("sequence_mask", 0.8, 1.2), beta=0.04),
    "sequence_truncate": dict(loss_type="sapo", correction=("sequence_truncate", None, 1.1)),
    "token_truncate": dict(loss_type="cispo", epsilon_high=0.5, correction=("token_truncate", 0.9, 1.1)),
    "token_mask": dict(loss_type="bnpo", correction=("token_mask", 0.9, 1.1)),
    "vespo with token_mask": dict(loss_type="vespo", correction=("token_mask", 0.9, 1.1)),
    "vespo with token_truncate": dict(loss_type="vespo", correction=("token_truncate", None, 1.05)),
    "off-policy mask": dict(loss_type="dapo", threshold=0.01),
    "off-policy mask and correction": dict(loss_type="luspo", level="sequence", threshold=0.0,
                                           correction=("sequence_mask", None, 3.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_trls(name, seed):
    tensors = random_tensors(seed)
    theirs = trl_loss(tensors, **CASES[name])
    (want,) = torch.autograd.grad(theirs, tensors[0])
    got_loss = ours(tensors, **CASES[name])
    (got,) = torch.autograd.grad(got_loss, tensors[0])
    assert abs(got_loss.item() - theirs.item()) < 1e-6, (got_loss.item(), theirs.item())
    assert (got - want).abs().max() < 1e-6


def test_adaptive_entropy_coefficient_steps_toward_the_target():
    assert L.adaptive_entropy_coef(0.1, 0.15, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.105)
    assert L.adaptive_entropy_coef(0.1, 0.25, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.095)
    assert L.adaptive_entropy_coef(0.999, 0.1, 0.2, 0.005, 0.0, 1.0) == 1.0
    assert L.adaptive_entropy_coef(0.001, 3.0, 0.2, 0.005, 0.0, 1.0) == 0.0


def test_rloo_is_the_leave_one_out_baseline():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(4 * G, generator=g, dtype=torch.float64)
    want = torch.tensor([rewards[i] - sum(rewards[j] for j in range(i // G * G, i // G * G + G) if j != i) / (G - 1)
                         for i in range(len(rewards))])
    assert (L.rloo_advantages(rewards, G) - want).abs().max() < 1e-12
    rewards[1] = float("nan")  # unscorable: out of its group's baselines, advantage 0
    got = L.rloo_advantages(rewards, G)
    assert got[1] == 0 and got[0] == pytest.approx((rewards[0] - rewards[2]).item())


def test_reinforce_pp_normalises_over_the_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    want = (rewards - rewards.mean()) / (rewards.std() + L.STD_EPS)
    assert (L.reinforce_pp_advantages(rewards) - want).abs().max() < 1e-12


def test_the_correction_ratio_and_off_policy_mask_do_what_they_say():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.4]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5], [0.2, 0.1]]))
    mask = torch.ones(2, 2)
    assert torch.allclose(L.sampling_ratio(old, sampler, mask, "token_truncate", None, 3.0),
                          torch.tensor([[2.0, 1.0], [1.0, 3.0]]))  # 0.4 / 0.1 = 4, truncated to 3
    assert torch.allclose(L.sampling_ratio(old, sampler, mask, "sequence_mask", None, 3.0),
                          torch.tensor([[2.0], [0.0]]))  # 2 x 1 kept; 1 x 4 masked
    adv = torch.tensor([-1.0, 1.0])
    keep = L.off_policy_mask(adv, old, sampler, mask, threshold=0.1)  # row 0: mean KL est. -0.35, kept
    assert keep.tolist() == [[1.0], [1.0]]
    assert L.off_policy_mask(adv, sampler, old, mask, threshold=0.1).tolist() == [[0.0], [1.0]]
    with pytest.raises(ValueError, match="must be one of"):
        L.sampling_ratio(old, sampler, mask, "tokens")


def test_vespo_folds_a_sequence_ratio_into_its_weight_as_the_product_of_token_ratios():
    logps, old, ref, adv, mask, entropies = random_tensors(0)
    sampler = sampler_logps((logps, old))
    per_token = L.sampling_ratio(old, sampler, mask, "token_truncate", None, None)  # no clip: exact ratios
    per_sequence = L.sampling_ratio(old, sampler, mask, "sequence_truncate", None, None)
    log_ratio = logps.detach() - old
    a = L.gamma_weights(adv.unsqueeze(1), log_ratio, mask, L.LossOptions(), per_token * mask + (1 - mask))
    b = L.gamma_weights(adv.unsqueeze(1), log_ratio, mask, L.LossOptions(), per_sequence)
    assert (a - b).abs().max() < 1e-9


def trl_async_loss(logps, sampler, adv, mask, epsilon=0.2, epsilon_high=0.28):
    """TRL 1.16's AsyncGRPOTrainer.compute_loss on the same tokens: its packed row holds every completion token
    (token_index into the model's flat logprobs), the ratio to the logprobs the sampler drew (`old_log_probs`)."""
    trainer_module = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
    selected = mask.reshape(-1).nonzero().squeeze(1)
    rows = torch.arange(B).unsqueeze(1).expand(B, T).reshape(-1)[selected]
    n = torch.tensor([float(selected.numel())])
    zeros = torch.zeros(1, B * T, dtype=torch.long)
    inputs = dict(attention_mask=torch.ones(1, B * T, dtype=torch.long), token_index=selected, input_ids=zeros,
                  position_ids=zeros, shift_labels=zeros, old_log_probs=sampler.reshape(-1)[selected],
                  advantages=adv[rows], segment_id=rows, tree_kv_index=torch.tensor([-1]),
                  tree_cu_seqlens_q=torch.tensor([-1]), tree_cu_seqlens_k=torch.tensor([-1]),
                  tree_max_seqlens=torch.tensor([[0, 0]]), global_n_tokens=n, global_n_forward_tokens=n,
                  mean_seq_len=torch.tensor([float(T)]))
    model = lambda **kw: SimpleNamespace(log_probs=logps.reshape(1, -1), entropy=torch.zeros(1, B * T))  # noqa: E731
    trainer = SimpleNamespace(epsilon_low=epsilon, epsilon_high=epsilon_high, accelerator=OneProcess(),
                              current_gradient_accumulation_steps=1, aux_loss_enabled=False,
                              _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0,
                              _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0,
                              _step_forward_s=0.0)
    return trainer_module.AsyncGRPOTrainer.compute_loss(trainer, model, inputs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_old_logprobs_engine_with_the_default_correction_is_trls_async_loss(seed):
    # a stale sample: the sampler's logprobs up to 0.6 nats from the trainer's, so some ratios leave the clip range
    logps, old, _, adv, mask, _ = random_tensors(seed)
    g = torch.Generator().manual_seed(100 + seed)
    sampler = logps.detach() + 0.6 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    theirs = trl_async_loss(logps, sampler, adv, mask)
    (want,) = torch.autograd.grad(theirs, logps)
    # rlcu with old_logprobs='engine': the ratio's old logprobs are the sampler's, and TRL's sampling correction (on
    # by default) divides them by themselves
    ratio = L.sampling_ratio(sampler, sampler, mask, "sequence_mask", None, 3.0)
    ptl, coef, _ = L.per_token_loss(logps, sampler, adv, mask, 0.2, 0.28, "token", None, 0.0, "dapo", L.LossOptions(),
                                    None, ratio, None)
    clipped = ((coef > 1.28) & (adv.unsqueeze(1) > 0) | (coef < 0.8) & (adv.unsqueeze(1) < 0)) & mask.bool()
    assert clipped.any()
    got_loss = L.aggregate_loss(ptl, mask, "dapo", T + 3, 1, mask.sum())
    (got,) = torch.autograd.grad(got_loss, logps)
    assert abs(got_loss.item() - theirs.item()) < 1e-9, (got_loss.item(), theirs.item())
    assert (got - want).abs().max() < 1e-9
