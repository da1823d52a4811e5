"""The AdamW step (Triton, the CPU step over torch's fused AdamW in chunks, and the PyTorch reference)
against torch.optim.AdamW in float64, and the stochastic rounding of bf16 moments against round-to-nearest,
which stalls."""
import pytest
import torch

from rlcu.kernels import _triton
from rlcu.kernels.adamw import AdamWStep, adamw_step_cpu, adamw_step_reference, adamw_step_triton, stochastic_round_bf16
from tests.helpers import KERNEL_DEVICE as DEVICE

IMPLEMENTATIONS = ["reference", "cpu"] + (["triton"] if _triton.HAS_TRITON else [])
CHUNK = 1000  # the CPU step's chunk in these tests: tensors of 4099 elements cross several
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def step_with(impl, master, grad, m, v, s, out=None):
    if impl == "triton":
        adamw_step_triton(master, grad, m, v, s, out)
    elif impl == "cpu":
        adamw_step_cpu(master.cpu(), grad.cpu(), m.cpu(), v.cpu(), s, None if out is None else out.cpu(), chunk=CHUNK)
    else:
        adamw_step_reference(master, grad, m, v, s, out, torch.Generator(master.device).manual_seed(s.seed))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_step_matches_torch_adamw_in_float64(impl, grad_dtype, n):
    g = torch.Generator().manual_seed(n)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(5)]
    scale = 0.37  # a clipping coefficient
    exact = start.double().clone().requires_grad_(True)
    ref = torch.optim.AdamW([exact], **HYPER)
    device = "cpu" if impl == "cpu" else DEVICE
    master, out = start.clone().to(device), torch.empty(n, dtype=torch.float16, device=device)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    for t, grad in enumerate(grads, 1):
        exact.grad = grad.double() * scale
        ref.step()
        step_with(impl, master, grad.to(device), m, v, AdamWStep(1e-2, 0.9, 0.999, 1e-8, 0.1, t, scale), out)
    assert torch.allclose(master.double().cpu(), exact.detach(), atol=1e-6, rtol=1e-5)
    assert torch.equal(out.cpu(), master.cpu().to(torch.float16)), "out holds the master in the model's dtype"
    assert torch.allclose(v.double().cpu(), ref.state[exact]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bf16_moments_track_fp32_where_round_to_nearest_stalls(impl):
    """v starts at 1 and is fed g^2 = 2: each step adds 0.1% of v, under half of bf16's spacing at 1."""
    n, steps = 4096, 200
    device = "cpu" if impl == "cpu" else DEVICE
    hyper = AdamWStep(0.0, 0.9, 0.999, 1e-8, 0.0, 1)
    m32, v32 = torch.zeros(n), torch.ones(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16, device=device), torch.ones(n, dtype=torch.bfloat16, device=device)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.full((n,), 2.0 ** 0.5)
    for t in range(1, steps + 1):
        s = AdamWStep(**{**hyper.__dict__, "step": t, "seed": t})
        step_with("reference", torch.zeros(n), grad, m32, v32, s)
        step_with(impl, torch.zeros(n, device=device), grad.to(device), m16, v16, s)
        nearest = (nearest.float() * 0.999 + 0.001 * 2.0).to(torch.bfloat16)
    expected = float(v32.mean())
    assert expected > 1.15  # the fp32 estimate moved
    assert float(nearest.float().mean()) == 1.0, "round-to-nearest was expected to stall here"
    assert abs(float(v16.float().mean()) - expected) < 0.01 * expected


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(impl):
    x = torch.full((1 << 16,), 1.0 + 2 ** -9)  # a quarter of the way from 1 to the next bf16 (1 + 2^-7)
    if impl == "triton":  # through the kernel: the moment of a zero-lr step with b1 = 0 is the gradient itself
        m = torch.zeros(x.shape, dtype=torch.bfloat16, device=DEVICE)
        v = torch.zeros_like(m)
        adamw_step_triton(torch.zeros(x.shape, device=DEVICE), x.to(DEVICE), m, v,
                          AdamWStep(0.0, 0.0, 0.999, 1e-8, 0.0, 1, seed=3))
        rounded = m.float().cpu()
    elif impl == "cpu":  # the same zero-lr step through the CPU step's own noise; b2 = 0: v is g^2, half-way up
        m, v = torch.zeros(x.shape, dtype=torch.bfloat16), torch.zeros(x.shape, dtype=torch.bfloat16)
        adamw_step_cpu(torch.zeros(x.shape), x, m, v, AdamWStep(0.0, 0.0, 0.0, 1e-8, 0.0, 1, seed=3), chunk=CHUNK)
        rounded, v_up = m.float(), v.float() > 1.0
        assert set(v.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
        assert abs(float(v_up.float().mean()) - 0.5005) < 0.01
        assert abs(float((v_up & (rounded > 1.0)).float().mean()) - 0.25 * 0.5005) < 0.01  # m's and v's bits apart
    else:
        rounded = stochastic_round_bf16(x, torch.Generator().manual_seed(3)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float((rounded == 1.0 + 2 ** -7).float().mean()) - 0.25) < 0.01


@pytest.mark.parametrize("impl", ["reference"] + (["triton"] if _triton.HAS_TRITON else []))
def test_a_bf16_master_is_rounded_stochastically(impl):
    """A bf16 weight as its own master (master_weights=False): a step of a quarter of bf16's spacing above 1 lands
    on 1 or the next bf16 value, the next a quarter of the time, so that the mean is the fp32 step's."""
    n = 1 << 16
    master = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    m, v = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    # b1 = b2 = 0: m = g, v = g^2, so the step is lr * sign(-g) (eps aside)
    step_with(impl, master, torch.full((n,), -1.0, device=DEVICE), m, v, AdamWStep(2 ** -9, 0.0, 0.0, 1e-12, 0.0, 1,
                                                                                      seed=5))
    got = master.float().cpu()
    assert set(got.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float((got > 1.0).float().mean()) - 0.25) < 0.01
