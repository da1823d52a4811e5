"""LoRA's decode-size update of a fused projection (shrink + expand) against float64 and the PyTorch reference, on odd
shapes: parts of sizes that are no multiple of a tile, a part without an adapter between adapted ones, K across
several slices, ranks below the dot's 16."""
import pytest
import torch

from rlcu.kernels import _triton
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 5e-3), torch.bfloat16: (5e-2, 2e-2)}


def adapter(parts: dict[str, int], targets: list[str], r: int, k: int, dtype, seed: int):
    """A [targets * r, K], B [adapted rows, r] and the column maps, laid out as `LoraAdapter` lays them out."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(len(targets) * r, k, generator=g) / k ** 0.5
    b = torch.randn(sum(parts[t] for t in targets), r, generator=g)
    rows, firsts, row, slot = [], [], 0, 0
    for name, size in parts.items():
        if name in targets:
            rows += range(row, row + size)
            firsts += [slot * r] * size
            row, slot = row + size, slot + 1
        else:
            rows += [-1] * size
            firsts += [0] * size
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE), as_int(rows), as_int(firsts)


def float64_update(y, x, a, b, parts, targets, r, scaling):
    out, col, row, slot = y.double().cpu().clone(), 0, 0, 0
    x64, a64, b64 = x.double().cpu(), a.double().cpu(), b.double().cpu()
    for name, size in parts.items():
        if name in targets:
            h = x64 @ a64[slot * r:(slot + 1) * r].t()
            out[:, col:col + size] += scaling * h @ b64[row:row + size].t()
            row, slot = row + size, slot + 1
        col += size
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 40), (5, 600), (64, 1100), (128, 96)])
@pytest.mark.parametrize("parts,targets,r", [
    ({"q_proj": 200, "k_proj": 24, "v_proj": 40}, ["q_proj", "v_proj"], 8),  # k_proj between, not adapted
    ({"gate_proj": 150, "up_proj": 150}, ["gate_proj", "up_proj"], 16),
    ({"o_proj": 130}, ["o_proj"], 4),
])
def test_lora_update_against_float64(dtype, m, k, parts, targets, r):
    from rlcu.kernels.lora_update import lora_update_reference, lora_update_triton

    a, b, rows, firsts = adapter(parts, targets, r, k, dtype, seed=m + k + r)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(m, sum(parts.values()), generator=g).to(dtype).to(DEVICE)
    exact = float64_update(y, x, a, b, parts, targets, r, 2.0)
    got = lora_update_triton(y.clone(), x, a, b, rows, firsts, 2.0)
    ref = lora_update_reference(y.clone(), x, a, b, rows, firsts, 2.0)
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double().cpu(), exact, atol=atol, rtol=rtol), (got.double().cpu() - exact).abs().max()
    assert torch.allclose(ref.double().cpu(), exact, atol=atol, rtol=rtol)
    off = (rows < 0).cpu()
    assert torch.equal(got[:, off.to(DEVICE)], y[:, off.to(DEVICE)])  # a part without an adapter is untouched
    assert (got != y).any()


def test_fp32_adapters_round_to_the_inputs_dtype():
    """Under bf16 autocast the adapters may stay fp32 while x and y are half precision: A and B are rounded to x's
    dtype, as autocast rounds them for the PyTorch GEMMs."""
    from rlcu.kernels.lora_update import lora_update_reference, lora_update_triton

    parts, targets = {"q_proj": 48, "k_proj": 16, "v_proj": 16}, ["q_proj", "k_proj", "v_proj"]
    a, b, rows, firsts = adapter(parts, targets, 16, 256, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 256, generator=g).half().to(DEVICE)
    y = torch.randn(9, 80, generator=g).half().to(DEVICE)
    got = lora_update_triton(y.clone(), x, a, b, rows, firsts, 0.5)
    ref = lora_update_reference(y.clone(), x, a, b, rows, firsts, 0.5)
    exact = float64_update(y, x, a.half(), b.half(), parts, targets, 16, 0.5)
    assert torch.allclose(got.double().cpu(), exact, atol=1e-2, rtol=5e-3)
    assert torch.allclose(ref.double().cpu(), exact, atol=1e-2, rtol=5e-3)
