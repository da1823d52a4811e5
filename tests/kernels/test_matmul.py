"""The batch-invariant linear layer against float64 and the PyTorch reference on odd shapes, and its one
promise: a row's output bits do not depend on the rows around it."""
import pytest
import torch
import torch.nn.functional as F

from rlcu.kernels import _triton
from rlcu.kernels.matmul import (
    GroupRows,
    LowRank,
    add_low_rank,
    grouped_linear_triton,
    grouped_tile,
    invariant_grouped_linear,
    invariant_linear,
    launch,
    linear_reference,
    linear_triton,
    tiles,
)
from tests.helpers import KERNEL_DEVICE as DEVICE
from tests.helpers import KERNEL_DTYPES as DTYPES

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(1, 48, 64), (67, 100, 130), (130, 576, 4200), (5, 17, 3)]  # (M, K, N): tails in every dimension


def inputs(m, k, n, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_against_float64(dtype, m, k, n, bias):
    x, w, b = inputs(m, k, n, dtype, bias)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    atol, rtol = TOLERANCE[dtype]
    for got in (linear_triton(x, w, b), linear_reference(x, w, b)):
        assert got.dtype == dtype
        assert torch.allclose(got.double(), exact, atol=atol, rtol=rtol), (got.double() - exact).abs().max()


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [960, 2500])
def test_rows_are_batch_invariant(dtype, n):
    """Every row computed alone, among 7 and among 200 rows (in another position) is the same bits, although
    the three take different tiles (column widths, and at n=2500 K widths too)."""
    chosen = {m: tiles(m, n, 576) for m in (1, 7, 200)}
    assert len(set(chosen.values())) == 2 and (n < 2048 or chosen[1][2] != chosen[200][2])
    x, w, b = inputs(200, 576, n, dtype, seed=1)
    full = linear_triton(x, w, b)
    for i in (0, 63, 64, 199):
        assert torch.equal(linear_triton(x[i:i + 1], w, b), full[i:i + 1])
    window = linear_triton(x[60:67], w, b)
    assert torch.equal(window, full[60:67])
    shuffled = torch.randperm(200, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(linear_triton(x[shuffled], w, b), full[shuffled])


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("n,k", [(960, 576), (2100, 1040)])
def test_training_rows_take_their_own_tiles_with_the_same_bits(monkeypatch, n, k):
    """A training forward's many rows (here from 150, so that the interpreter gets through them) take 256- or
    128-row tiles by the layer's size; a row alone, in a decode step's tile, is the same bits."""
    from rlcu.kernels import matmul

    monkeypatch.setattr(matmul, "TRAINING_ROWS", 150)
    wide = tiles(200, n, k)
    assert wide[0] == (256 if n * k > 1 << 21 else 128) and tiles(200, n, k, element_size=4)[0] != 256
    x, w, b = inputs(200, k, n, torch.float16, seed=6)
    full = linear_triton(x, w, b)
    for i in (0, 130, 199):
        assert torch.equal(linear_triton(x[i:i + 1], w, b), full[i:i + 1])



@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("k,n", [(256, 88), (24, 256)])  # the GPU exact test's tiny hybrid: in_proj, out_proj
def test_rows_keep_their_bits_where_k_and_n_are_not_whole_tiles(monkeypatch, k, n):
    """A layer whose K or N is no multiple of any tile (Gated DeltaNet's fused in_proj of 88 columns, its out_proj
    of K=24): a row alone (a decode step's tile, K 128 wide), among 7, among 200 and in a training forward's tiles
    is the same bits."""
    from rlcu.kernels import matmul

    monkeypatch.setattr(matmul, "TRAINING_ROWS", 150)
    x, w, _ = inputs(200, k, n, DTYPES[-1], bias=False, seed=7)
    full = linear_triton(x, w)
    monkeypatch.setattr(matmul, "TRAINING_ROWS", 1 << 30)
    assert torch.equal(linear_triton(x, w), full) and tiles(200, n, k) != tiles(1, n, k)
    for i in (0, 77, 199):
        assert torch.equal(linear_triton(x[i:i + 1], w), full[i:i + 1])
    assert torch.equal(linear_triton(x[60:67], w), full[60:67])

def assert_same_values_and_gradients(got, want, got_leaves, want_leaves):
    assert got.shape == want.shape == (2, 3, 24)
    assert torch.allclose(got, want, atol=1e-5)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    for a, e in zip(got_leaves, want_leaves):
        assert torch.allclose(a.grad, e.grad, atol=1e-5)


def low_rank(m, n, r, dtype, seed=8, scale=1.75):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, r, generator=g).to(dtype).to(DEVICE)
    l_ = (torch.randn(n, r, generator=g) / r ** 0.5).to(dtype).to(DEVICE)
    return LowRank.dense(h, l_, scale)


def parts_low_rank(m, sizes, targeted, rank, dtype, seed=10, scale=0.5):
    """A fused projection's update: parts of `sizes` columns, those in `targeted` adapted (rank each), as the
    LoRA adapter's maps give it, beside the block-diagonal B it stands for."""
    g = torch.Generator().manual_seed(seed)
    n, slots = sum(sizes), len(targeted)
    h = torch.randn(m, slots * rank, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(sum(sizes[i] for i in targeted), rank, generator=g).to(dtype).to(DEVICE)
    rows, firsts = torch.full((n,), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    block = torch.zeros(n, slots * rank, dtype=dtype)
    start, row = 0, 0
    for i, size in enumerate(sizes):
        if i in targeted:
            slot = targeted.index(i)
            rows[start:start + size] = torch.arange(row, row + size)
            firsts[start:start + size] = slot * rank
            block[start:start + size, slot * rank:(slot + 1) * rank] = b[row:row + size].cpu()
            row += size
        start += size
    return LowRank(h, b, scale, rows.to(DEVICE), firsts.to(DEVICE)), block.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("r", [12, 48])  # a rank short of one 16-wide step, and three parts of rank 16
def test_low_rank_update_in_the_same_launch_against_float64(dtype, m, k, n, r):
    x, w, b = inputs(m, k, n, dtype)
    lr = low_rank(m, n, r, dtype)
    exact = x.double() @ w.double().t() + b.double() + lr.scale * lr.h.double() @ lr.l.double().t()
    got = linear_triton(x, w, b, lr)
    atol, rtol = TOLERANCE[dtype]
    assert got.dtype == dtype
    assert torch.allclose(got.double(), exact, atol=atol, rtol=rtol), (got.double() - exact).abs().max()
    assert not torch.allclose(linear_triton(x, w, b).double(), exact, atol=atol, rtol=rtol)  # the update counts


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("sizes,targeted,rank", [((96, 40, 40), (0, 1, 2), 16), ((96, 40, 40), (0, 2), 6),
                                                 ((70, 70), (1,), 8)])
def test_the_gathered_block_diagonal_is_the_block_diagonal_bit_for_bit(sizes, targeted, rank):
    """q/k/v-like parts (one untargeted, parts not whole tiles, a rank below one step): the kernel reading B's
    rows through the maps gives the bits of the same launch over the assembled block-diagonal B, which is
    near float64; `block_diagonal` assembles it."""
    dtype = DTYPES[-1]
    x, w, b = inputs(70, 64, sum(sizes), dtype, seed=11)
    lr, block = parts_low_rank(70, list(sizes), list(targeted), rank, dtype)
    assert torch.equal(lr.block_diagonal(), block)
    got = linear_triton(x, w, b, lr)
    assert torch.equal(got, linear_triton(x, w, b, LowRank.dense(lr.h, block, lr.scale)))
    exact = x.double() @ w.double().t() + b.double() + lr.scale * lr.h.double() @ block.double().t()
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), exact, atol=atol, rtol=rtol)


@pytest.mark.usefixtures("fixed_order_dot")
def test_the_update_added_after_the_product_gives_the_fused_launchs_bits():
    """Training may take the product from the vendor's GEMM and add the update in its own kernel: the same bits
    as the fused launch, because the fused launch rounds its product first."""
    dtype = DTYPES[-1]
    x, w, b = inputs(150, 80, 176, dtype, seed=12)
    lr, _ = parts_low_rank(150, [96, 40, 40], [0, 2], 16, dtype)
    assert torch.equal(add_low_rank(linear_triton(x, w, b), lr), linear_triton(x, w, b, lr))


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("r", [12, 48])
def test_rows_with_a_low_rank_update_are_batch_invariant(monkeypatch, r):
    """With the update, a row alone, among 7, among 200 and in a training forward's tiles is the same bits (the
    rank walked in 16-wide steps from 0 whatever the tile)."""
    from rlcu.kernels import matmul

    dtype, n, k = DTYPES[-1], 2500, 576
    x, w, b = inputs(200, k, n, dtype, seed=9)
    lr = low_rank(200, n, r, dtype)
    monkeypatch.setattr(matmul, "TRAINING_ROWS", 150)
    full = linear_triton(x, w, b, lr)
    monkeypatch.setattr(matmul, "TRAINING_ROWS", 1 << 30)
    assert torch.equal(linear_triton(x, w, b, lr), full) and tiles(200, n, k) != tiles(1, n, k)
    for i in (0, 77, 199):
        assert torch.equal(linear_triton(x[i:i + 1], w, b, lr._replace(h=lr.h[i:i + 1])), full[i:i + 1])
    assert torch.equal(linear_triton(x[60:67], w, b, lr._replace(h=lr.h[60:67])), full[60:67])


@pytest.mark.parametrize("parts", [False, True])
def test_low_rank_gradients_match_the_composed_linears(monkeypatch, parts):
    monkeypatch.setenv("RLCU_TRITON", "1")
    x, w, b = inputs(6, 40, 24, torch.float32, seed=3)
    lr, block = parts_low_rank(6, [10, 6, 8], [0, 2], 5, torch.float32) if parts else (low_rank(6, 24, 20,
                                                                                              torch.float32), None)
    r = lr.h.shape[1]
    x3, h3 = x.view(2, 3, 40), lr.h.view(2, 3, r)
    got_leaves = [t.clone().requires_grad_() for t in (x3, w, b, h3, lr.l)]
    want_leaves = [t.clone().requires_grad_() for t in (x3, w, b, h3, lr.l)]
    got = invariant_linear(*got_leaves[:3], lr._replace(h=got_leaves[3], l=got_leaves[4]))
    xw, ww, bw, hw, lw = want_leaves
    if parts:  # the block-diagonal B built from the leaf, as the adapter's default path builds it
        at = dict(device=DEVICE)
        lw_block = torch.zeros(24, r, **at).index_put((torch.arange(10, **at)[:, None], torch.arange(5, **at)),
                                                      lw[:10])
        lw = lw_block.index_put((torch.arange(16, 24, **at)[:, None], torch.arange(5, 10, **at)), lw[10:])
        assert torch.equal(lw.detach(), block)
    want = F.linear(xw, ww, bw) + lr.scale * F.linear(hw, lw)
    assert_same_values_and_gradients(got, want, got_leaves, want_leaves)


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("vendor", ["same bits", "one row tile split", "a shape of its own"])
def test_the_vendors_gemm_is_taken_only_where_it_gave_the_kernels_bits(monkeypatch, vendor):
    """From VENDOR_ROWS rows a shape's first product checks the vendor's GEMM at one row in every 16 and the last
    against the kernel: one that gives the kernel's bits is kept for the shape (and run alone afterwards); one
    that sums a row tile in another order (as a split K would) is caught and the kernel's output returned, for
    good."""
    from rlcu.kernels import matmul

    monkeypatch.setattr(matmul, "VENDOR_ROWS", 100)
    monkeypatch.setattr(matmul, "VENDOR_ON_CPU", True)
    monkeypatch.setattr(matmul, "VENDOR", matmul.VendorCheck())
    calls = []

    def fake_vendor(x, weight, bias=None):
        calls.append(x.shape[0])
        y = linear_triton(x, weight, bias)
        if vendor == "one row tile split" or vendor == "a shape of its own" and x.shape[0] == 300:
            y[128:144] = (y[128:144].double() * (1 + 2 ** -9)).to(y.dtype)  # a 16-row tile, every element
        return y

    monkeypatch.setattr(matmul, "vendor_linear", fake_vendor)
    x, w, b = inputs(300, 48, 40, torch.float32, seed=13)
    want = linear_triton(x, w, b)
    for _ in range(2):
        assert torch.equal(matmul.invariant_gemm(x, w, b), want)
    caught = vendor != "same bits"
    assert calls == ([300] if caught else [300, 300]) and list(matmul.VENDOR.verdicts.values()) == [not caught]
    assert torch.equal(matmul.invariant_gemm(x[:64], w, b), want[:64]) and calls[-1] == 300  # the kernel's rows
    if vendor == "a shape of its own":  # verdicts are per shape: another count of rows is checked afresh
        assert torch.equal(matmul.invariant_gemm(x[:200], w, b), want[:200]) and calls[-1] == 200
        assert list(matmul.VENDOR.verdicts.values()) == [False, True]
    before = len(calls)  # a caller that says vendor=False (an expert's rows) gets the kernel, unchecked
    assert torch.equal(matmul.invariant_gemm(x[:150], w, b, vendor=False), want[:150]) and len(calls) == before


@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_row_tiles_in_groups_cover_every_tile_with_the_same_bits(group_m):
    """11 row tiles by 5 column tiles: groups of 3 and 8 leave a short last group; each tile is written (the
    output starts as NaN) and its bits are those of the ungrouped order."""
    x, w, b = inputs(11 * 16 - 5, 40, 5 * 16 - 3, torch.float32, seed=5)
    want = torch.full((x.shape[0], w.shape[0]), float("nan"), device=DEVICE)
    launch(x, w, b, want, 16, 16, 16, 4, 2, group_m=1)
    assert torch.allclose(want.double(), x.double() @ w.double().t() + b.double(), atol=1e-5)
    got = torch.full_like(want, float("nan"))
    launch(x, w, b, got, 16, 16, 16, 4, 2, group_m=group_m)
    assert torch.equal(got, want)


def test_gradients_and_leading_dimensions_match_f_linear(monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    x, w, b = inputs(6, 40, 24, torch.float32, seed=3)
    x3 = x.view(2, 3, 40)
    got_leaves = [t.clone().requires_grad_() for t in (x3, w, b)]
    want_leaves = [t.clone().requires_grad_() for t in (x3, w, b)]
    got = invariant_linear(*got_leaves)
    want = F.linear(*want_leaves)
    assert_same_values_and_gradients(got, want, got_leaves, want_leaves)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 autocast: the interpreter's bf16 arithmetic is wrong")
def test_autocast_casts_like_f_linear():
    x, w, b = inputs(33, 64, 80, torch.float32, seed=4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = invariant_linear(x, w, b), F.linear(x, w, b)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_without_triton_it_says_how_to_get_it(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA tensor always has the kernel")
    monkeypatch.delenv("RLCU_TRITON", raising=False)
    x, w, b = inputs(2, 8, 4, torch.float32)
    with pytest.raises(RuntimeError, match="RLCU_TRITON=1"):
        invariant_linear(x, w, b)


# an empty group, every row on one, whole tiles, none; the last, in 16 bits, takes the training forward's tiles
GROUPS = [[5, 0, 70, 1], [0, 0, 133, 0], [64, 64, 1], [0, 0, 0], [300, 0, 260],
          [(7 * i) % 5 + (65 if i == 20 else 0) for i in range(37)]]  # groups not a power of two, one of 2 tiles


def grouped_inputs(counts, k, n, dtype, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(len(counts), n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    return x, w, torch.tensor(counts, device=DEVICE)


def group_loop(x, w, counts, linear):
    out, start = [], 0
    for g, c in enumerate(counts):
        out.append(linear(x[start:start + c], w[g]))
        start += c
    return torch.cat(out)


@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", GROUPS)
@pytest.mark.parametrize("k,n", [(100, 67), (48, 130)])
def test_grouped_kernel_against_a_loop_and_float64(dtype, counts, k, n):
    """One launch for every group, counts read on the device: each group's rows equal `linear_triton` on those rows
    bit for bit (so the engine and the trainer may take either), and float64 within the dtype's rounding."""
    x, w, c = grouped_inputs(counts, k, n, dtype)
    got = grouped_linear_triton(x, w, c)
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    assert torch.equal(got, group_loop(x, w, counts, linear_triton))
    exact = group_loop(x.double(), w.double(), counts, lambda a, b: a @ b.t())
    atol, rtol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), exact, atol=atol, rtol=rtol), (got.double() - exact).abs().max()


@pytest.mark.usefixtures("fixed_order_dot")
def test_grouped_rows_are_batch_invariant():
    """A row alone in its group, or in another position among other groups' rows, is the same bits, although the
    full launch (an average of 188 rows a group, 16 bits) takes 128-row tiles and the others 64-row ones."""
    counts = [300, 3, 260]
    x, w, c = grouped_inputs(counts, 96, 80, DTYPES[-1], seed=12)
    assert grouped_tile(563, 3, x.element_size())[0] == 128 and grouped_tile(12, 3)[0] == 64
    full = grouped_linear_triton(x, w, c)
    for i, g in ((0, 0), (299, 0), (301, 1), (562, 2)):
        alone = [0, 0, 0]
        alone[g] = 1
        assert torch.equal(grouped_linear_triton(x[i:i + 1], w, torch.tensor(alone, device=DEVICE)), full[i:i + 1])
    fewer = torch.tensor([5, 0, 7], device=DEVICE)
    rows = torch.cat([x[10:15], x[400:407]])
    assert torch.equal(grouped_linear_triton(rows, w, fewer), torch.cat([full[10:15], full[400:407]]))


def test_grouped_gradients_against_float64(monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    counts = [9, 0, 30]
    x, w, c = grouped_inputs(counts, 40, 24, torch.float32, seed=13)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    got = invariant_grouped_linear(*leaves, c)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    got_grads = torch.autograd.grad(got, leaves, grad)
    leaves64 = [t.double().requires_grad_() for t in (x, w)]
    want = group_loop(*leaves64, counts, lambda a, b: a @ b.t())
    want_grads = torch.autograd.grad(want, leaves64, grad.double())
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=1e-5), (a.double() - b).abs().max()


@pytest.mark.usefixtures("fixed_order_dot")
def test_group_rows_make_the_offsets_once_for_every_launch_over_the_same_rows():
    """An MoE layer's launches share one `GroupRows`: the same output as from the counts, its offsets made once."""
    counts = [7, 0, 12]
    x, w, c = grouped_inputs(counts, 40, 24, DTYPES[0], seed=15)
    groups = GroupRows(c)
    assert torch.equal(grouped_linear_triton(x, w, groups), grouped_linear_triton(x, w, c))
    ends = groups.ends()
    grouped_linear_triton(x, w[:, :8].contiguous(), groups)
    assert groups.ends() is ends and ends.tolist() == [7, 7, 19]
