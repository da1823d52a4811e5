"""fp32 master weights for bf16 parameters, against plain fp32 AdamW on the same gradients."""
import pytest
import torch

from rlcu.grpo.optim import MasterWeightAdamW


def run(steps=100, lr=1e-4):
    torch.manual_seed(0)
    start = (torch.randn(64) + 1.0).to(torch.bfloat16).float()  # representable in bf16: all start equal
    grads = [(1 + 0.5 * torch.randn(64)).to(torch.bfloat16).float() for _ in range(steps)]  # a steady drift
    ref = start.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.01)
    low = torch.nn.Parameter(start.to(torch.bfloat16))
    opt = MasterWeightAdamW([low], lr=lr, weight_decay=0.01)
    naive = torch.nn.Parameter(start.to(torch.bfloat16))
    naive_opt = torch.optim.AdamW([naive], lr=lr, weight_decay=0.01)
    for g in grads:
        for p, o in ((ref, ref_opt), (low, opt), (naive, naive_opt)):
            o.zero_grad()
            p.grad = g.to(p.dtype)
            o.step()
    return start, ref, low, opt, naive


def test_master_weights_follow_fp32_adamw_where_bf16_alone_stalls():
    start, ref, low, opt, naive = run()
    # gradients reach the masters through bf16, so they differ from fp32 AdamW by that rounding only
    assert torch.allclose(opt.masters[0], ref.detach(), atol=1e-6)
    assert torch.equal(low.detach(), opt.masters[0].to(torch.bfloat16)), "the bf16 weights are the rounded masters"
    moved = (ref.detach() - start).abs()
    assert moved.min() > 5e-3  # 100 steps of ~1e-4 each
    stalled = (naive.detach().float() == start).float().mean()
    assert stalled > 0.5, "pure bf16 AdamW was expected to lose most of these small updates"
    assert (low.detach().float() - ref.detach()).abs().max() <= 2 ** -7 * ref.detach().abs().max()  # one bf16 ulp


def test_state_dict_carries_the_masters():
    _, _, low, opt, _ = run(steps=10)
    saved = opt.state_dict()
    fresh_param = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    fresh = MasterWeightAdamW([fresh_param], lr=1e-4, weight_decay=0.01)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.masters[0], opt.masters[0])
    assert torch.equal(fresh_param.detach(), low.detach())
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


def test_bf16_moments_stay_bf16_through_a_checkpoint():
    param = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    opt = MasterWeightAdamW([param], lr=1e-3, state_dtype=torch.bfloat16)
    param.grad = torch.randn(64).to(torch.bfloat16)
    opt.step()
    assert opt.state[opt.masters[0]]["exp_avg_sq"].dtype == torch.bfloat16
    fresh = MasterWeightAdamW([torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))], lr=1e-3,
                              state_dtype=torch.bfloat16)
    fresh.load_state_dict(opt.state_dict())
    state = fresh.state[fresh.masters[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg_sq"], opt.state[opt.masters[0]]["exp_avg_sq"]) and state["step"] == 1


def test_an_fp32_parameter_is_its_own_master_and_grad_scale_is_torchs_clipping():
    torch.manual_seed(1)
    start, grad = torch.randn(100), 10 * torch.randn(100)
    ours = torch.nn.Parameter(start.clone())
    opt = MasterWeightAdamW([ours], lr=1e-2, weight_decay=0.01)
    assert opt.masters[0] is ours and "masters" not in opt.state_dict()
    ref = torch.nn.Parameter(start.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    ours.grad, ref.grad = grad.clone(), grad.clone()
    norm = float(opt.grad_norm())
    assert abs(norm - float(grad.norm())) < 1e-4
    torch.nn.utils.clip_grads_with_norm_([ref], 1.0, torch.tensor(norm))
    opt.step(grad_scale=min(1.0, 1.0 / (norm + 1e-6)))
    ref_opt.step()
    assert torch.allclose(ours.detach(), ref.detach(), atol=1e-7)


def test_grad_norm_of_bf16_gradients_is_accumulated_in_fp32():
    params = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)) for _ in range(3)]
    opt = MasterWeightAdamW(params)
    for i, p in enumerate(params):
        p.grad = torch.full((4096,), 1.0 + i, dtype=torch.bfloat16)
    exact = (4096 * (1 + 4 + 9)) ** 0.5
    assert opt.grad_norm().dtype == torch.float32
    assert abs(float(opt.grad_norm()) - exact) < 1e-3


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_offloaded_state_lives_on_the_host_and_steps_as_the_device_one(state_dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(2)
    start = torch.randn(3, 70).to(torch.bfloat16).to(device)
    grads = [torch.randn(3, 70).to(torch.bfloat16).to(device) for _ in range(4)]
    params = {o: torch.nn.Parameter(start.clone()) for o in (False, True)}
    opts = {o: MasterWeightAdamW([params[o]], lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, offload=o)
            for o in (False, True)}
    for g in grads:
        for o in (False, True):
            params[o].grad = g.clone()
            opts[o].step(grad_scale=0.5)
    state = opts[True].state[opts[True].masters[0]]
    assert opts[True].masters[0].device.type == state["exp_avg"].device.type == "cpu"
    assert state["exp_avg_sq"].dtype == state_dtype
    assert params[True].device.type == device and params[True].dtype == torch.bfloat16
    # fp32 moments: the same update (on a GPU the device step is the Triton kernel, the host one PyTorch);
    # bf16 moments are rounded stochastically, so they agree within a bf16 ulp of the weights
    tol = 1e-6 if state_dtype == torch.float32 else 3e-2
    assert torch.allclose(opts[True].masters[0].to(device), opts[False].masters[0], atol=tol)
    assert (params[True].float() - params[False].float()).abs().max() <= 2 ** -7 * start.float().abs().max() + tol


def test_offload_under_fsdp_is_refused_with_the_reason():
    class Shard(torch.nn.Parameter):  # stands for a DTensor shard: what fsdp2 gives the optimizer
        def to_local(self):
            return self

    with pytest.raises(ValueError, match="under fsdp2 the state is sharded across GPUs already"):
        MasterWeightAdamW([Shard(torch.zeros(4))], offload=True)


def test_without_masters_bf16_weights_follow_fp32_adamw_in_expectation():
    """master_weights=False: the bf16 weights are AdamW's own, rounded stochastically. Over 100 steps of about
    1e-4 (a tenth of bf16's spacing at these weights), the mean drift equals fp32 AdamW's where torch's AdamW on
    the same bf16 weights loses most steps; no fp32 copy is kept."""
    torch.manual_seed(0)
    n, steps, lr = 4096, 100, 1e-4
    start = (torch.randn(n) + 1.0).to(torch.bfloat16).float()
    grads = [(1 + 0.5 * torch.randn(n)).to(torch.bfloat16).float() for _ in range(steps)]
    ref = start.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.01)
    own = torch.nn.Parameter(start.to(torch.bfloat16))
    opt = MasterWeightAdamW([own], lr=lr, weight_decay=0.01, state_dtype=torch.bfloat16, master_weights=False)
    assert opt.masters[0] is own and "masters" not in opt.state_dict()
    naive = torch.nn.Parameter(start.to(torch.bfloat16))
    naive_opt = torch.optim.AdamW([naive], lr=lr, weight_decay=0.01)
    for g in grads:
        for p, o in ((ref, ref_opt), (own, opt), (naive, naive_opt)):
            p.grad = g.to(p.dtype)
            o.step()
    assert own.dtype == torch.bfloat16 and opt.state[own]["exp_avg"].dtype == torch.bfloat16
    drift, want = float((own.detach().float() - start).mean()), float((ref.detach() - start).mean())
    assert want < -5e-3 and abs(drift - want) < 0.05 * abs(want)
    assert (naive.detach().float() == start).float().mean() > 0.5, "round-to-nearest was expected to stall"
    # each weight within a few of its bf16 spacings of fp32 AdamW's
    assert ((own.detach().float() - ref.detach()).abs() <= 4 * 2 ** -7 * ref.detach().abs().clamp(min=1)).all()


def test_without_masters_the_weights_must_be_bf16_and_on_the_device():
    with pytest.raises(ValueError, match=r"not \['torch.float16'\]: load the model in bfloat16"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], master_weights=False)
    with pytest.raises(ValueError, match="master_weights=False updates the weights where they are; optimizer_offload"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], master_weights=False,
                          offload=True)
