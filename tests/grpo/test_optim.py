"""fp32 master weights for bf16 parameters, against plain fp32 AdamW on the same gradients."""
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
