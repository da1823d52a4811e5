"""varlen_attention (Triton, under the interpreter on the CPU) against float64 autograd of the PyTorch reference
(`sdpa`), on odd lengths: packed sequences and a padded batch's rows, soft-capping, sinks, windows, GQA."""
import pytest
import torch

from rlcu.kernels.sdpa import sdpa
from rlcu.kernels.varlen_attention import BLOCK, varlen_attention, varlen_tiles

pytest.importorskip("triton")


def reference(q, k, v, bounds, t, scale, window, sinks, softcap):
    """Each sequence alone through `sdpa` in float64; rows in no sequence 0."""
    out = torch.zeros(t, q.shape[1], q.shape[2], dtype=torch.float64)
    for lo, hi in bounds:
        n = hi - lo
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[:, None] - pos[None, :] < window
        one = sdpa(*(x[lo:hi].transpose(0, 1)[None] for x in (q, k, v)), mask[None, None], scale, sinks, softcap)
        out[lo:hi] = one[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize(("window", "softcap", "sinks", "d"), [(None, None, False, 16), (None, 2.0, False, 16),
                                                               (None, None, True, 24), (5, 1.5, True, 16),
                                                               (40, None, False, 32)])
def test_forward_and_gradients_equal_float64_autograd(layout, window, softcap, sinks, d):
    g = torch.Generator().manual_seed(0)
    if layout == "packed":
        lengths = [1, 7, 37, 5]
        cut = torch.tensor([0, *lengths]).cumsum(0).tolist()
        bounds, t = list(zip(cut[:-1], cut[1:])), cut[-1]
    else:  # rows of 40 with padding before and after each row's tokens
        bounds, t = [(3, 38), (40 + 0, 40 + 9), (80 + 20, 80 + 40)], 120
    hq, hkv, scale = 4, 2, 0.3
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, generator=g, dtype=torch.float64) if sinks else None
    grad = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    leaves64 = [x.clone().requires_grad_() for x in (q, k, v, *([sink] if sinks else []))]
    want = reference(*leaves64[:3], bounds, t, scale, window, leaves64[3] if sinks else None, softcap)
    want_grads = torch.autograd.grad(want, leaves64, grad)
    leaves = [x.float().requires_grad_() for x in leaves64]
    tiles = varlen_tiles(torch.tensor([b[0] for b in bounds]), torch.tensor([b[1] for b in bounds]), "cpu")
    assert tiles.tolist() == [[a, lo, hi] for lo, hi in bounds for a in range(lo, hi, BLOCK)]
    got = varlen_attention(*leaves[:3], tiles, scale, window, leaves[3] if sinks else None, softcap)
    got_grads = torch.autograd.grad(got, leaves, grad.float())
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5, msg=name)
    inside = torch.zeros(t, dtype=torch.bool)
    for lo, hi in bounds:
        inside[lo:hi] = True
    assert not got[~inside].any() and not got_grads[0][~inside].any() and not got_grads[1][~inside].any()
