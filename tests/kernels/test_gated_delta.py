"""Gated DeltaNet's pieces against references: the chunked delta rule against the token-by-token recurrence in
float64 (odd lengths around the chunk size, grouped value heads, states brought in), a sequence split into chunks
of 7 and 11 tokens against the whole, gradients against float64 autograd of the recurrence, and the convolution
against torch's conv1d per sequence. On the GPU, flash-linear-attention's kernels against the same float64."""
import pytest
import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON
from rlcu.kernels.gated_delta import (
    causal_conv,
    causal_conv_exact,
    causal_conv_step,
    causal_conv_step_,
    fla_ops,
    gated_delta_exact,
    gated_delta_reference,
    gated_delta_rule,
    gated_delta_step_,
    gates,
)

LENGTHS = [1, 5, 63, 64, 65, 130]


def inputs(lengths, hk=2, hv=4, dk=8, dv=6, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = dict(q=torch.randn(t, hk, dk, generator=g), k=torch.randn(t, hk, dk, generator=g),
             v=torch.randn(t, hv, dv, generator=g), g=-torch.rand(t, hv, generator=g) * 0.5,
             beta=torch.rand(t, hv, generator=g))
    state = torch.randn(len(lengths), hv, dk, dv, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {k: v.to(device, dtype) for k, v in x.items()}, state.to(device), cu.to(device)


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_the_recurrence_in_float64(with_state):
    x, state, cu = inputs(LENGTHS)
    state = state if with_state else None
    want, want_state = gated_delta_reference(**x, cu=cu, state=state, dtype=torch.float64)
    got, got_state = gated_delta_rule(**x, cu=cu, state=state)
    assert got.shape == want.shape and got_state.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5
    assert (got_state.double() - want_state).abs().max() < 1e-5


def test_a_sequence_in_chunks_of_7_and_11_continues_from_its_state():
    x, _, cu = inputs([40])
    whole, whole_state = gated_delta_rule(**x, cu=cu)
    outs, state, start = [], None, 0
    for n in [7, 11, 7, 11, 4]:
        part = {k: v[start:start + n] for k, v in x.items()}
        o, state = gated_delta_rule(**part, cu=torch.tensor([0, n], dtype=torch.int32), state=state, decode=n == 1)
        outs.append(o)
        start += n
    assert (torch.cat(outs) - whole).abs().max() < 1e-5 and (state - whole_state).abs().max() < 1e-5


def test_gradients_equal_float64_autograd_of_the_recurrence():
    x, state, cu = inputs([3, 70, 20])
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    s0 = state.clone().requires_grad_()
    o, s = gated_delta_rule(**leaves, cu=cu, state=s0)
    g = torch.Generator().manual_seed(1)
    do, ds = torch.randn(o.shape, generator=g), torch.randn(s.shape, generator=g)
    ((o * do).sum() + (s * ds).sum()).backward()
    leaves64 = {k: v.double().detach().requires_grad_() for k, v in x.items()}
    s064 = state.double().requires_grad_()
    o64, s64 = gated_delta_reference(**leaves64, cu=cu, state=s064, dtype=torch.float64)
    ((o64 * do.double()).sum() + (s64 * ds.double()).sum()).backward()
    for name in leaves:
        want = leaves64[name].grad
        assert (leaves[name].grad.double() - want).abs().max() < 1e-4 * (1 + want.abs().max()), name
    assert (s0.grad.double() - s064.grad).abs().max() < 1e-4


def test_the_convolution_per_sequence_and_continued_from_a_window():
    g = torch.Generator().manual_seed(0)
    lengths, c, k = [1, 2, 9, 3], 10, 4
    x, w = torch.randn(sum(lengths), c, generator=g), torch.randn(c, k, generator=g)
    cu = torch.tensor([0, 1, 3, 12, 15])
    got, last = causal_conv(x, w, cu, None)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seq = F.pad(x[a:b].T[None], (k - 1, 0))
        assert (got[a:b] - F.silu(F.conv1d(seq, w[:, None], groups=c))[0].T).abs().max() < 1e-6
        assert torch.equal(last[i], seq[0, :, -(k - 1):])  # the window the next tokens continue from
    first, window = causal_conv(x[3:7], w, torch.tensor([0, 4]), None)
    rest, end = causal_conv(x[7:12], w, torch.tensor([0, 5]), window)
    assert (torch.cat([first, rest]) - got[3:12]).abs().max() < 1e-6 and torch.equal(end[0], last[2])
    one, shifted = causal_conv_step(x[11:12], w, causal_conv(x[3:11], w, torch.tensor([0, 8]), None)[1])
    assert (one - got[11:12]).abs().max() < 1e-6 and torch.equal(shifted[0], last[2])  # the decode step's form


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fla_ops() is None, reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("decode", [False, True])
def test_flash_linear_attention_against_float64(decode):
    lengths = [1] * 33 if decode else [1, 63, 64, 65, 300]
    x, state, cu = inputs(lengths, hk=4, hv=8, dk=128, dv=128, dtype=torch.bfloat16, device="cuda")
    got, got_state = gated_delta_rule(**x, cu=cu, state=state, decode=decode)
    want, want_state = gated_delta_reference(**{k: v.cpu() for k, v in x.items()}, cu=cu.cpu(), state=state.cpu(),
                                             dtype=torch.float64)
    assert (got.double().cpu() - want).abs().max() < 0.05 * (1 + want.abs().max())
    assert (got_state.double().cpu() - want_state).abs().max() < 0.05 * (1 + want_state.abs().max())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dk,dv", [(24, 40), (128, 128)])
def test_the_in_place_decode_step_against_float64(monkeypatch, dk, dv):
    """Our Triton decode step (the interpreter on the CPU) updates only the slots it is given, in place, as the
    float64 recurrence does; odd head sizes take masked tiles, 128 x 128 several value blocks."""
    monkeypatch.setenv("RLCU_TRITON", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, _, _ = inputs([1] * 5, hk=2, hv=4, dk=dk, dv=dv, device=device)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(9, 4, dk, dv, generator=gen).to(device)
    a, b, a_log, dt_bias = (torch.randn(*shape, generator=gen).to(device) for shape in [(5, 4), (5, 4), (4,), (4,)])
    a[0, 0] = 30.0  # past softplus's threshold
    x["g"], x["beta"] = gates(a, b, a_log, dt_bias)
    slots = torch.tensor([7, 0, 3, 8, 2], device=device)
    want, want_state = gated_delta_reference(**x, cu=torch.arange(6, device=device), state=pool[slots],
                                             dtype=torch.float64)
    updated = pool.clone()
    qkv = torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], dim=1)  # views of one row, as the layer
    q, k, v = qkv.split([2 * dk, 2 * dk, 4 * dv], dim=1)
    got = gated_delta_step_(q.unflatten(1, (2, dk)), k.unflatten(1, (2, dk)), v.unflatten(1, (4, dv)), a, b, a_log,
                            dt_bias, pool=updated, slots=slots)
    assert (got.double() - want).abs().max() < 1e-5
    assert (updated[slots].double() - want_state).abs().max() < 1e-5
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(updated[others], pool[others])


@pytest.mark.parametrize("triton_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_decode_step_over_a_narrow_state_pool(monkeypatch, triton_kernel, dtype):
    """`mamba_ssm_cache_dtype` bfloat16 / float16: the step reads each state from the pool, computes in fp32 as over
    an fp32 pool, and writes the new state rounded once: the float64 recurrence from the same stored states, its
    output within fp32's error and its new state within one rounding of the pool's dtype (Triton under the
    interpreter, and the PyTorch path)."""
    if triton_kernel and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if triton_kernel:
        monkeypatch.setenv("RLCU_TRITON", "1")
    else:
        monkeypatch.delenv("RLCU_TRITON", raising=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, _, _ = inputs([1] * 3, hk=2, hv=4, dk=24, dv=40, device=device)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(5, 4, 24, 40, generator=gen).to(device, dtype)
    a, b, a_log, dt_bias = (torch.randn(*shape, generator=gen).to(device) for shape in [(3, 4), (3, 4), (4,), (4,)])
    x["g"], x["beta"] = gates(a, b, a_log, dt_bias)
    slots = torch.tensor([4, 1, 2], device=device)
    want, want_state = gated_delta_reference(**x, cu=torch.arange(4, device=device), state=pool[slots],
                                             dtype=torch.float64)
    updated = pool.clone()
    got = gated_delta_step_(x["q"], x["k"], x["v"], a, b, a_log, dt_bias, pool=updated, slots=slots)
    assert updated.dtype == dtype
    assert (got.double() - want).abs().max() < 1e-5
    spacing = torch.finfo(dtype).eps * want_state.abs() + 1e-6  # one rounding to the pool's dtype: half of this
    assert ((updated[slots].double() - want_state).abs() <= spacing).all()
    assert torch.equal(updated[[0, 3]], pool[[0, 3]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fla_ops() is None, reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("dk", [64, 128])  # fla's key tiles on Hopper: 64 wide (miscompiled there), and 128
def test_gradients_on_cuda_against_float64(dk):
    """Through whichever backward the GPU takes: fla's; fla's with its Hopper guard lifted, where the probe found
    it right at these shapes; or the PyTorch chunked form's."""
    x, state, cu = inputs([3, 70, 20], hk=2, hv=4, dk=dk, dv=64, device="cuda")
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    o, s = gated_delta_rule(**leaves, cu=cu, state=state)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).cuda()
    (o * do).sum().backward()
    cpu = {k: v.detach().cpu().double().requires_grad_() for k, v in x.items()}
    o64, _ = gated_delta_reference(**cpu, cu=cu.cpu(), state=state.cpu(), dtype=torch.float64)
    (o64 * do.cpu().double()).sum().backward()
    for name in leaves:
        want = cpu[name].grad
        assert (leaves[name].grad.double().cpu() - want).abs().max() < 1e-2 * (1 + want.abs().max()), name


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("triton_kernel", [False, True])
def test_the_in_place_convolution_step(monkeypatch, triton_kernel):
    """The decode step's convolution on windows in a pool (our Triton kernel, on a GPU or interpreted, or PyTorch):
    the out-of-place form's output, the windows shifted in their slots only; 300 channels cross a block edge."""
    if triton_kernel:
        monkeypatch.setenv("RLCU_TRITON", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton compiled for a GPU takes its tensors only
    gen = torch.Generator().manual_seed(3)
    c, k = 300, 4
    rows = torch.randn(5, c + 7, generator=gen).to(device)
    x, w = rows[:, 7:], torch.randn(c, k, generator=gen).to(device)  # x a strided view, as the layer's projection
    pool = torch.randn(9, c, k - 1, generator=gen).to(device)
    slots = torch.tensor([7, 0, 3, 8, 2], device=device)
    want, want_windows = causal_conv_step(x, w, pool[slots])
    updated = pool.clone()
    got = causal_conv_step_(x, w, updated, slots)
    assert (got - want).abs().max() < 1e-5 and torch.equal(updated[slots], want_windows)
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(updated[others], pool[others])


def test_fla_is_called_with_its_gates_by_name():
    """fla's two rules take different fifth parameters (the chunked one beta, the recurrent one `gk`, a decay per
    key): beta passed by position turned the recurrent rule's output to NaN on the H200. A stand-in that takes
    only q, k and v by position checks that everything else goes by name."""
    from rlcu.kernels.gated_delta import _fla

    seen = {}

    def op(q, k, v, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        seen.update(g=g, beta=beta)
        return v.clone(), initial_state

    x, state, cu = inputs([1, 1, 1])
    _fla(op, x["q"], x["k"], x["v"], x["g"], x["beta"], cu, state)
    assert torch.equal(seen["beta"][0], x["beta"].to(x["v"].dtype)) and torch.equal(seen["g"][0], x["g"].float())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dk,dv", [(8, 6), (24, 40), (128, 128)])  # (8, 6): the GPU exact test's tiny model
@pytest.mark.parametrize("act,weight", [("float32", "float32"), ("half", "float32"), ("half", "half")])
def test_exact_sequences_are_decode_steps_bit_for_bit(monkeypatch, dk, dv, act, weight):
    """Exact numerics' sequence kernels (the interpreter on the CPU, the GPU where there is one): three sequences
    (1, 9 and 13 tokens) from states in a pool give the bits of the decode kernels run one token at a time, and the
    same again when each is fed in chunks of 4 tokens that continue from the pool; outputs and final states near the
    float64 recurrence. Activations and weights as a model has them: fp32 alone, 16-bit activations over fp32
    weights (autocast), 16-bit both (bf16 on the GPU, fp16 under the interpreter)."""
    monkeypatch.setenv("RLCU_TRITON", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = torch.bfloat16 if device == "cuda" else torch.float16
    act, weight = (half if d == "half" else torch.float32 for d in (act, weight))
    lengths, c, kw = [1, 9, 13], 37, 4
    x, _, cu = inputs(lengths, hk=2, hv=4, dk=dk, dv=dv, device=device, dtype=act)
    gen = torch.Generator().manual_seed(5)
    t = sum(lengths)
    a, b = (torch.randn(t, 4, generator=gen).to(device, act) for _ in range(2))
    a_log, dt_bias = (torch.randn(4, generator=gen).to(device, weight) for _ in range(2))
    mixed, w = torch.randn(t, c, generator=gen).to(device, act), torch.randn(c, kw, generator=gen).to(device, weight)
    pool = torch.randn(6, 4, dk, dv, generator=gen).to(device)
    windows = torch.randn(6, c, kw - 1, generator=gen).to(device, act)
    slots = torch.tensor([4, 0, 2], device=device)
    q, k, v = x["q"], x["k"], x["v"]

    def stepwise():
        states, wins, outs, convs = pool.clone(), windows.clone(), [], []
        bounds = cu.tolist()
        for token in range(max(lengths)):  # decode steps of the sequences still running
            rows = [i for i in range(3) if token < lengths[i]]
            at = torch.tensor([bounds[i] + token for i in rows], device=device)
            sl = slots[rows]
            convs.append((at, causal_conv_step_(mixed[at], w, wins, sl)))
            outs.append((at, gated_delta_step_(q[at], k[at], v[at], a[at], b[at], a_log, dt_bias, states, sl)))
        o, y = torch.empty_like(v), torch.empty_like(mixed)
        for at, out in outs:
            o[at] = out
        for at, out in convs:
            y[at] = out
        return o, y, states, wins

    def chunked(size):
        states, wins, o, y = pool.clone(), windows.clone(), torch.empty_like(v), torch.empty_like(mixed)
        for start in range(0, max(lengths), size):
            rows = [i for i in range(3) if start < lengths[i]]
            pieces = [torch.arange(cu[i] + start, min(cu[i] + start + size, cu[i + 1]), device=device) for i in rows]
            at = torch.cat(pieces)
            part = torch.tensor([0, *torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()], dtype=torch.int32,
                                device=device)
            y[at] = causal_conv_exact(mixed[at], w, part, wins, slots[rows])
            o[at] = gated_delta_exact(q[at], k[at], v[at], a[at], b[at], a_log, dt_bias, part, states, slots[rows])
        return o, y, states, wins

    want = stepwise()
    for got in (chunked(max(lengths)), chunked(4)):
        for g_, w_ in zip(got, want):
            assert torch.equal(g_, w_)
    g, beta = gates(a, b, a_log, dt_bias)
    ref, ref_state = gated_delta_reference(q, k, v, g, beta, cu, pool[slots], dtype=torch.float64)
    tol = 1e-5 if act == torch.float32 else 0.05 * ref.abs().max().item()  # one rounding of each output to 16 bits
    assert (want[0].double() - ref).abs().max() < tol and (want[2][slots].double() - ref_state).abs().max() < tol


@pytest.mark.parametrize("with_state", [False, True])
def test_the_chunk_scans_written_out_backward_against_autograd_in_float64(with_state):
    """The chunked form's scan over chunks differentiates by a loop written out: gradcheck in float64 over every
    input that asks for a gradient (the state only when a sequence brings one), then autograd of the plain loop."""
    from rlcu.kernels.gated_delta import _ChunkScan
    g = torch.Generator().manual_seed(3)
    n, hv, chunks, c, dk, dv = 2, 3, 3, 5, 4, 6
    x = [torch.randn(n, hv, chunks, c, d, generator=g, dtype=torch.float64) for d in (dv, dk, dk)]
    scores = torch.randn(n, hv, chunks, c, c, generator=g, dtype=torch.float64)
    kend = torch.randn(n, hv, chunks, c, dk, generator=g, dtype=torch.float64)
    decay = torch.rand(n, hv, chunks, generator=g, dtype=torch.float64)
    s0 = torch.randn(n, hv, dk, dv, generator=g, dtype=torch.float64)
    args = [t.requires_grad_() for t in (*x, scores, kend, decay)] + [s0.requires_grad_(with_state)]
    assert torch.autograd.gradcheck(_ChunkScan.apply, args)
    # only the output's gradient, as the training forward's layers ask (no gradient reaches the last state)
    o, _ = _ChunkScan.apply(*args)
    grads = torch.autograd.grad(o.sum(), args[:6])
    o_ref, _ = _scan_by_autograd(*args)
    for got, want in zip(grads, torch.autograd.grad(o_ref.sum(), args[:6])):
        assert (got - want).abs().max() < 1e-10


def _scan_by_autograd(u0, w, qd, scores, kend, decay, s):
    outs = []
    for i in range(u0.shape[2]):
        u = u0[:, :, i] - w[:, :, i] @ s
        outs.append(qd[:, :, i] @ s + scores[:, :, i] @ u)
        s = s * decay[:, :, i, None, None] + kend[:, :, i].transpose(-1, -2) @ u
    return torch.stack(outs, 2), s


class _GuardedBackward(torch.autograd.Function):
    """Stands for fla's chunked backward where its Hopper guard refuses it: raises unless the guard's flag is
    lifted, and, `wrong`, returns a gradient half again too large (the miscompile the guard is for)."""

    @staticmethod
    def forward(ctx, o, guard, wrong):
        ctx.guard, ctx.wrong = guard, wrong
        return o.clone()

    @staticmethod
    def backward(ctx, grad):
        if not ctx.guard.TRITON_ABOVE_3_7_1:
            raise RuntimeError("the guard refused the backward")
        return grad * (1.5 if ctx.wrong else 1.0), None, None


def _stand_in_fla(monkeypatch, wrong):
    """fla's chunked rule, stood in for on the CPU by the PyTorch chunked form behind `_GuardedBackward`, with its
    guard module; fla's own backward reported unsound, as on Hopper under Triton 3.6."""
    import sys
    import types

    from rlcu.kernels import gated_delta as gd

    guard = types.ModuleType("fla.ops.common.chunk_o")
    guard.TRITON_ABOVE_3_7_1 = False
    common = types.ModuleType("fla.ops.common")
    common.chunk_o = guard
    for name, module in [("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.common", common), ("fla.ops.common.chunk_o", guard)]:
        monkeypatch.setitem(sys.modules, name, module)

    def chunk(q, k, v, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        o, final = gd._chunked_torch(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state)
        return _GuardedBackward.apply(o, guard, wrong)[None], final

    monkeypatch.setattr(gd, "fla_ops", lambda: (chunk, None))
    monkeypatch.setattr(gd, "fla_backward_sound", lambda device: False)
    gd.fla_backward_probed.cache_clear()
    return gd, guard


@pytest.mark.parametrize("wrong", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_fla_backward_is_probed_where_its_guard_refuses_it(monkeypatch, wrong, checkpointed):
    """Where fla's guard refuses its backward, one probe at the layer's shapes decides: a right backward is run with
    the guard lifted for it alone, a wrong one gives way to the PyTorch form's. Either way the gradients equal float64
    autograd of the recurrence, also when the probe first runs inside a checkpointed layer."""
    gd, guard = _stand_in_fla(monkeypatch, wrong)
    x, state, cu = inputs([3, 70, 20])
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    calls, forward = [], gd._FlaChunked.forward

    def counted(ctx, *args):
        calls.append("fla" if args[-1] else "fla, the PyTorch form's backward")
        return forward(ctx, *args)

    monkeypatch.setattr(gd._FlaChunked, "forward", staticmethod(counted))

    def layer(q, k, v, g, beta):
        # sin saves its input: under the checkpoint, its backward recomputes the layer before the rule's backward
        return gd._fla_trainable(q, k, v, g, beta, cu, state)[0].sin()

    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
    o = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if checkpointed else layer(*args)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    (o * do).sum().backward()
    assert gd.fla_backward_probed(torch.device("cpu"), 2, 4, 8, 6, torch.float32) is (not wrong)
    assert calls.count("fla") == (1 if wrong else 2 + checkpointed)  # the probe, then the layer (twice: checkpoint)
    assert guard.TRITON_ABOVE_3_7_1 is False  # lifted for the backward alone
    cpu = {k: v.double().detach().requires_grad_() for k, v in x.items()}
    o64, _ = gated_delta_reference(**cpu, cu=cu, state=state, dtype=torch.float64)
    (o64.sin() * do.double()).sum().backward()
    for name in leaves:
        want = cpu[name].grad
        assert (leaves[name].grad.double() - want).abs().max() < 1e-4 * (1 + want.abs().max()), name
    gd.fla_backward_probed.cache_clear()


def test_a_probe_that_fails_leaves_fla_backward_off(monkeypatch, caplog):
    """fla refusing in another way, or its kernels failing to compile, turn the probe's answer to no, with a
    warning that names the error: the PyTorch form's backward runs."""
    gd, _ = _stand_in_fla(monkeypatch, wrong=False)

    def refuses(*args, **kwargs):
        raise ValueError("a shape fla does not take")

    monkeypatch.setattr(gd, "fla_ops", lambda: (refuses, None))
    assert gd.fla_backward_probed(torch.device("cpu"), 2, 4, 8, 6, torch.float32) is False
    assert "ValueError: a shape fla does not take" in caplog.text
    gd.fla_backward_probed.cache_clear()

