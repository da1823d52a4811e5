"""Gated DeltaNet's token mixing (Qwen3.5, Qwen3-Next): a short causal convolution, then the gated delta rule,
over sequences laid one after another in a flat row (`cu` [N + 1] marks where each starts), each continuing
from a state it brings (the engine's pool: a prefill chunk after an earlier one, a decode step, a fork).

The recurrence, per value head, with S [Dk, Dv] starting at the sequence's state:
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
with q and k L2-normalised and q scaled by Dk^-0.5. `gated_delta_reference` is that loop, token by token (the
oracle of the tests, in float64). `gated_delta_rule` computes the same sums in chunks (the WY form: within a
chunk the updates solve one triangular system, across chunks the state carries): flash-linear-attention's Triton
kernels on CUDA (the `hybrid` extra), a PyTorch form of the chunked algorithm elsewhere. States are float32.
The engine's decode steps update each sequence's state in its pool slot (`gated_delta_step_`, our Triton kernel).
Exact numerics run every token as such a step does (`causal_conv_exact`, `gated_delta_exact`: the same per-token
body, looped over a sequence's tokens), so that no sum depends on how a sequence was chunked or batched."""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton
from rlcu.kernels.causal_conv import causal_conv_triton

log = logging.getLogger(__name__)

CHUNK = 64  # tokens per chunk of the PyTorch form: its triangular solves are CHUNK x CHUNK
L2_EPS = 1e-6  # the eps under the L2 norm's square root (fla's and transformers')


@functools.cache
def fla_ops():
    """(chunked, recurrent) gated delta rule of flash-linear-attention, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def require_fla() -> None:
    if fla_ops() is None:
        raise ImportError("linear-attention layers (Qwen3.5, Qwen3-Next) need flash-linear-attention on CUDA: "
                          "pip install 'rlcu[hybrid]'")


def causal_conv(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor, window: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with SiLU: x [T, C] (sequences at `cu`), weight [C, K], `window` [N, C, K - 1]
    the inputs before each sequence's first token (None: zeros) -> (out [T, C], each sequence's last K - 1 inputs
    [N, C, K - 1], the window its next tokens continue from). With Triton (CUDA), our kernels
    (`causal_conv.causal_conv_triton`) where no gradient is asked of the window; elsewhere `causal_conv_reference`."""
    if use_triton(x) and len(x) and (window is None or not window.requires_grad):
        return causal_conv_triton(x, weight, cu, window), _last_inputs(x, cu, window, weight.shape[1] - 1)
    return causal_conv_reference(x, weight, cu, window)


def causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor, window: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` in PyTorch. Each sequence gets its window laid in front of it, and one depthwise convolution
    without padding runs over the lot: an output at a sequence's token reads only that sequence's window and
    tokens."""
    t, c = x.shape
    n, k = len(cu) - 1, weight.shape[1]
    w = k - 1
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(n, device=x.device), lengths, output_size=t)
    token_at = torch.arange(t, device=x.device) + (seq + 1) * w  # a token's row in the extended layout
    starts = cu[:-1].long() + torch.arange(n, device=x.device) * w  # each sequence's window's first row
    window_at = (starts[:, None] + torch.arange(w, device=x.device)).reshape(-1)
    if window is None:
        window = x.new_zeros(n, c, w)
    ext = x.new_zeros(t + n * w, c)
    ext = ext.index_copy(0, token_at, x).index_copy(0, window_at, window.transpose(1, 2).reshape(-1, c).to(x.dtype))
    out = F.conv1d(ext.T[None], weight.to(x.dtype)[:, None], groups=c)[0].T  # row r reads ext rows r .. r + w
    y = F.silu(out[token_at - w])
    ends = cu[1:].long() + (torch.arange(n, device=x.device) + 1) * w
    last = ext[(ends[:, None] - w + torch.arange(w, device=x.device)).reshape(-1)].reshape(n, w, c).transpose(1, 2)
    return y, last


def _last_inputs(x, cu, window, w):
    """Each sequence's last w inputs [N, C, w] (x's dtype): its own tokens, and before its first its window's."""
    n, starts = len(cu) - 1, cu[:-1].long()
    at = cu[1:].long()[:, None] - w + torch.arange(w, device=x.device)  # [N, w] rows of x
    mine = (at >= starts[:, None])[..., None]
    if window is None:
        before = x.new_zeros(n, w, x.shape[1])
    else:
        pos = (at - starts[:, None] + w).clamp(0, w - 1)  # where a row before the sequence sits in its window
        before = window.transpose(1, 2)[torch.arange(n, device=x.device)[:, None], pos]
    return torch.where(mine, x[at.clamp(min=0)], before.to(x.dtype)).transpose(1, 2)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` for one token a sequence: x [N, C], weight [C, K], window [N, C, K - 1] -> (out [N, C], the
    window shifted by x). The sum in fp32, rounded to x's dtype before SiLU, as the training forward's convolution
    rounds. Fixed shapes and no host reads: a CUDA graph captures it."""
    full = torch.cat([window.to(x.dtype), x[..., None]], dim=-1)  # [N, C, K]
    return F.silu((full.float() * weight.float()).sum(-1).to(x.dtype)), full[..., 1:]


def causal_conv_step_(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`causal_conv_step` on windows that live in `pool` [S, C, K - 1] at `slots` [N], shifted there in place:
    x [N, C] (rows at any stride) -> out [N, C], rounded as `causal_conv_step` rounds."""
    if use_triton(pool):
        return _conv_triton(x, weight, pool, slots, None)
    out, window = causal_conv_step(x, weight, pool[slots])
    pool.index_copy_(0, slots, window.to(pool.dtype))
    return out


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta):
    """fp32, q/k normalised, q scaled, q/k heads repeated to the value heads ([T, Hv, D] each)."""
    group = v.shape[1] // k.shape[1]
    q, k = (l2_normalize(x.float()).repeat_interleave(group, dim=1) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def gated_delta_reference(q, k, v, g, beta, cu: torch.Tensor, state: torch.Tensor | None = None,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, in `dtype`: q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv], `state`
    [N, Hv, Dk, Dv] (None: zeros) -> (o [T, Hv, Dv], final states [N, Hv, Dk, Dv]), both in `dtype`."""
    q, k, v, g, beta = (x.to(dtype) for x in _prepare(q, k, v, g, beta))
    n, hv, dk, dv = len(cu) - 1, v.shape[1], q.shape[-1], v.shape[-1]
    outs, finals = [], []
    bounds = cu.tolist()
    for i in range(n):
        s = state[i].to(dtype) if state is not None else q.new_zeros(hv, dk, dv)
        for t in range(bounds[i], bounds[i + 1]):
            s = s * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
            s = s + k[t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        finals.append(s)
    return torch.stack(outs) if outs else v.new_zeros(0, hv, dv), torch.stack(finals)


def gated_delta_rule(q, k, v, g, beta, cu: torch.Tensor, state: torch.Tensor | None = None,
                     decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in chunks (module docstring): shapes as `gated_delta_reference`'s; `decode`: one token a
    sequence (the recurrent kernel). Returns (o [T, Hv, Dv] in v's dtype, final states [N, Hv, Dk, Dv] fp32)."""
    if q.is_cuda:
        require_fla()
        inputs = (q, k, v, g, beta, state)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _fla_trainable(q, k, v, g, beta, cu, state)
        return _fla(fla_ops()[1 if decode else 0], q, k, v, g, beta, cu, state)
    return _chunked_torch(q, k, v, g, beta, cu, state)


def _fla(op, q, k, v, g, beta, cu, state):
    """One of fla's gated delta rules over the flat row (its batch of one, `cu_seqlens`), q/k normalised inside."""
    init = None if state is None else state.float()
    # by keyword: the recurrent op's fifth parameter is `gk` (a decay per key), not beta
    o, final = op(q[None], k[None], v[None], g=g[None].float(), beta=beta[None].to(v.dtype), initial_state=init,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
    return o[0].to(v.dtype), final.float()


def _fla_trainable(q, k, v, g, beta, cu, state):
    """fla's chunked rule where its backward is sound, or was found right at these shapes with fla's guard lifted
    (`fla_backward_probed`); elsewhere fla's forward and the PyTorch chunked form's backward."""
    if fla_backward_sound(q.device):
        return _fla(fla_ops()[0], q, k, v, g, beta, cu, state)
    right = fla_backward_probed(q.device, q.shape[1], v.shape[1], q.shape[2], v.shape[2], v.dtype)
    return _FlaChunked.apply(q, k, v, g, beta, cu, state, right)


@functools.cache
def fla_backward_sound(device: torch.device) -> bool:
    """fla 0.6.0 refuses its chunked backward on Hopper under Triton 3.4 to 3.7.0 (wrong gradients there, its
    issue #640), the Triton that torch 2.11 ships."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return True
    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    return not (3, 4, 0) <= version < (3, 7, 1)


@functools.cache
def fla_backward_probed(device: torch.device, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> bool:
    """Whether fla's chunked backward, refused by its guard (`fla_backward_sound`), is right anyway at these head
    counts, widths and dtype. The guard refuses every shape, where the miscompiled kernel (its dq/dk/dw/dg kernel)
    was found wrong at 64-wide key tiles only, and fla tiles a 128-wide key by 128 on Hopper. So one backward of
    two short sequences runs with the guard lifted, against the PyTorch chunked form's gradients of the same
    inputs; fla's backward is used where they agree (within bf16's rounding: the miscompile's errors were of the
    gradients' own size)."""
    if _fla_guard() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    t = 109  # two sequences: a whole chunk of 64 tokens, and 45

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    x = [rand(t, hk, dk).to(dtype), rand(t, hk, dk).to(dtype), rand(t, hv, dv).to(dtype),
         -rand(t, hv).abs() * 0.3, rand(t, hv).sigmoid().to(dtype)]
    state, cu = rand(2, hv, dk, dv, scale=0.1), torch.tensor([0, 64, t], device=device, dtype=torch.int32)
    do = rand(t, hv, dv).to(dtype)
    # the first training forward asks, maybe inside a checkpointed layer: the probe's graphs keep their own tensors
    # (a checkpoint's hooks would count them as the layer's) and its own precision
    with torch.autograd.graph.saved_tensors_hooks(lambda a: a, lambda a: a), torch.enable_grad(), \
            torch.autocast(device.type, enabled=False):
        try:
            got = _grads(lambda *a: _FlaChunked.apply(*a, True), x, cu, state, do)
        except Exception as e:  # another refusal or a failed compile: the probe only ever turns a speed-up on
            log.warning("fla's chunked backward failed its probe at %d/%d heads %dx%d %s (%s: %s); the PyTorch "
                        "form's backward runs instead", hk, hv, dk, dv, dtype, type(e).__name__, e)
            return False
        want = _grads(_chunked_torch, [a.float() for a in x], cu, state, do.float())
    ok = all(((a.float() - b).abs().max() <= 0.05 * (1 + b.abs().max())).item() for a, b in zip(got, want))
    log.info("fla's chunked backward at %d/%d heads %dx%d %s under Triton %s on Hopper: %s", hk, hv, dk, dv, dtype,
             triton.__version__, "right, used" if ok else "wrong, the PyTorch form's used instead")
    return ok


def _grads(rule, x, cu, state, do):
    leaves = [a.detach().requires_grad_() for a in x]
    o, _ = rule(*leaves, cu, state)
    return torch.autograd.grad(o, leaves, do)


def _fla_guard():
    """fla's module whose flag its Hopper guard reads (the flag's name in 0.6.0), or None where fla has another."""
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        return None
    return chunk_o if hasattr(chunk_o, "TRITON_ABOVE_3_7_1") else None


@contextlib.contextmanager
def fla_guard_lifted():
    """fla's Hopper guard lifted while the block runs (where `fla_backward_probed` found its backward right)."""
    module = _fla_guard()
    saved, module.TRITON_ABOVE_3_7_1 = module.TRITON_ABOVE_3_7_1, True
    try:
        yield
    finally:
        module.TRITON_ABOVE_3_7_1 = saved


def _grad_of(outs, grads, leaves):
    """Gradients of `outs` against `grads` at `leaves` (None where one is absent or needs none)."""
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
    return [next(got) if t is not None and t.requires_grad else None for t in leaves]


class _FlaChunked(torch.autograd.Function):
    """fla's chunked forward. The backward runs the forward again, recording its graph, and differentiates it: fla's
    own with its Hopper guard lifted (`fla_backward`, where `fla_backward_probed` found it right), else the PyTorch
    chunked form (where fla's backward is unsound and was not found right). A graph recorded in the forward would
    hold its tensors through a checkpoint's hooks, and its backward would ask the checkpoint to recompute the layer
    a second time."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu, state, fla_backward: bool):
        ctx.fla_backward = fla_backward
        ctx.save_for_backward(q, k, v, g, beta, cu, state)
        return _fla(fla_ops()[0], q, k, v, g, beta, cu, state)

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        q, k, v, g, beta, cu, state = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[:5], ctx.needs_input_grad[6])
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((q, k, v, g, beta, state), needs)]
        rule = functools.partial(_fla, fla_ops()[0]) if ctx.fla_backward else _chunked_torch
        with torch.enable_grad():
            outs = rule(*leaves[:5], cu, leaves[5])
            with fla_guard_lifted() if ctx.fla_backward else contextlib.nullcontext():
                out = _grad_of(outs, (grad_o, grad_final), leaves)
        return (*out[:5], None, out[5], None)


def _chunked_torch(q, k, v, g, beta, cu, state):
    """The chunked form in PyTorch: sequences right-padded to whole chunks (a padded token has g = 0 and beta = 0,
    which leaves the state as it is), all chunks' triangular systems solved at once, then the scan over chunks."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    n, hv, dk, dv = len(cu) - 1, v.shape[1], q.shape[-1], v.shape[-1]
    lengths = (cu[1:] - cu[:-1]).long()
    longest = int(lengths.max()) if n else 0
    c = CHUNK if longest > CHUNK else max(longest, 1)
    padded = -(-longest // c) * c
    seq = torch.repeat_interleave(torch.arange(n, device=q.device), lengths, output_size=len(q))
    pos = torch.arange(len(q), device=q.device) - cu[:-1].long()[seq]

    def grid(x):  # [T, Hv, ...] -> [N, Hv, chunks, c, ...]
        out = x.new_zeros(n, padded, *x.shape[1:])
        out = out.index_put((seq, pos), x).reshape(n, padded // c, c, *x.shape[1:])
        return out.permute(0, 3, 1, 2) if x.dim() == 2 else out.permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc, bc = grid(q), grid(k), grid(v), grid(g), grid(beta)  # gc/bc: [N, Hv, chunks, c]
    gamma = gc.cumsum(-1)  # log-decay from the chunk's start through each token
    decay = (gamma[..., :, None] - gamma[..., None, :])  # [.., i, j]: from token j to token i
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # u = T (beta v - beta e^gamma K S0), T = (I + A)^-1, A_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (j < i)
    a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2))) * decay.masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    system = eye + a
    u0 = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (bc * gamma.exp())[..., None] * kc, upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay.masked_fill(~causal, float("-inf")).exp()
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    s = q.new_zeros(n, hv, dk, dv) if state is None else state.float()
    o, s = _ChunkScan.apply(u0, w, q_decayed, scores, k_to_end, gamma[..., -1].exp(), s)
    return o.permute(0, 2, 3, 1, 4).reshape(n, padded, hv, dv)[seq, pos].to(dtype), s


class _ChunkScan(torch.autograd.Function):
    """The scan over chunks, from the state s before chunk 0: per chunk i,
        u = u0_i - w_i s;   o_i = qd_i s + scores_i u;   s <- decay_i s + kend_i^T u
    (u0, w, qd, kend [N, Hv, chunks, c, D], scores [N, Hv, chunks, c, c], decay [N, Hv, chunks]) -> (o [N, Hv,
    chunks, c, Dv], the last state). Its backward is the same loop reversed, written out: autograd through the loop's
    slices of each input would make a whole zero gradient of that input per chunk and add them up."""

    @staticmethod
    def forward(ctx, u0, w, qd, scores, kend, decay, s):
        o = torch.empty_like(u0)
        before, us = [], []  # the state each chunk starts from, and its u: kept as they are made, not copied
        for i in range(u0.shape[2]):
            u = u0[:, :, i] - w[:, :, i] @ s
            o[:, :, i] = qd[:, :, i] @ s + scores[:, :, i] @ u
            before.append(s)
            us.append(u)
            s = s * decay[:, :, i, None, None] + kend[:, :, i].transpose(-1, -2) @ u
        ctx.save_for_backward(w, qd, scores, kend, decay, *us, *before)
        return o, s

    @staticmethod
    def backward(ctx, do, ds):
        w, qd, scores, kend, decay, *saved = ctx.saved_tensors
        chunks = w.shape[2]
        us, before = saved[:chunks], saved[chunks:]
        du = w.new_empty(*w.shape[:-1], us[0].shape[-1])
        dw, dqd, dkend, dscores, ddecay = (torch.empty_like(x) for x in (w, qd, kend, scores, decay))
        for i in reversed(range(chunks)):
            s, u, do_i = before[i], us[i], do[:, :, i]
            du[:, :, i] = kend[:, :, i] @ ds + scores[:, :, i].transpose(-1, -2) @ do_i
            dkend[:, :, i] = u @ ds.transpose(-1, -2)
            ddecay[:, :, i] = (ds * s).sum((-1, -2))
            dscores[:, :, i] = do_i @ u.transpose(-1, -2)
            dqd[:, :, i] = do_i @ s.transpose(-1, -2)
            dw[:, :, i] = -(du[:, :, i] @ s.transpose(-1, -2))
            ds = ds * decay[:, :, i, None, None] + qd[:, :, i].transpose(-1, -2) @ do_i \
                - w[:, :, i].transpose(-1, -2) @ du[:, :, i]
        return du, dw, dqd, dscores, dkend, ddecay, ds


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """The decay's log and beta from the layer's projections (transformers' rounding): g = -e^A_log softplus(a +
    dt_bias) in fp32, beta = sigmoid(b) in b's dtype."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_delta_step_(q, k, v, a, b, A_log, dt_bias, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode step of N sequences whose states live in `pool` [S, Hv, Dk, Dv] at `slots` [N]: the recurrence's
    one token each in fp32, the states updated in place (rounded to the pool's dtype where it is narrower). q/k
    [N, Hk, Dk], v [N, Hv, Dv] (views of the layer's projection are read where they are), a/b [N, Hv] the decay's
    and beta's logits (`gates`) -> o [N, Hv, Dv] in v's dtype. A decode step's state traffic is its largest: one
    read and one write of each state, where gathering into a batch and scattering back would add a copy each way."""
    if use_triton(pool) and q.shape[-1] <= 256:
        return _delta_triton(q, k, v, a, b, A_log, dt_bias, pool, slots)
    g, beta = gates(a, b, A_log, dt_bias)
    o, final = gated_delta_reference(q, k, v, g, beta, torch.arange(len(q) + 1, device=q.device), pool[slots])
    pool.index_copy_(0, slots, final.to(pool.dtype))
    return o.to(v.dtype)


def causal_conv_exact(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor, pool: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """Exact numerics' convolution: `causal_conv` token by token, each token as a decode step computes it
    (`causal_conv_step_`), so its sums never depend on how the sequence was chunked or batched. x [T, C] (sequences
    at `cu`, rows at any stride), each sequence's window in `pool` [S, C, K - 1] at `slots` [N], shifted there in
    place -> out [T, C]. Gradients, where recorded, are `causal_conv`'s, recomputed."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ExactConv.apply(x, weight, cu, pool, slots)
    return _conv_sequences(x, weight, cu, pool, slots)


def _conv_sequences(x, weight, cu, pool, slots):
    if not use_triton(pool):
        outs = []
        for i, (a, b) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
            for t in range(a, b):  # one decode step at a time
                outs.append(causal_conv_step_(x[t:t + 1], weight, pool, slots[i:i + 1]))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    return _conv_triton(x, weight, pool, slots, cu)


def _conv_triton(x, weight, pool, slots, cu):
    """`cu` None: one token a sequence (a decode step)."""
    t, c = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    k, block_c, n = weight.shape[1], 256, len(slots)
    _conv_sequences_kernel[(n, triton.cdiv(c, block_c))](x, weight, pool, slots.long(), _cu32(cu, x.device), out,
                                                         x.stride(0), c, k, int(cu is None), BLOCK_C=block_c,
                                                         BLOCK_K=next_pow2(k), enable_fp_fusion=False)
    return out


def gated_delta_exact(q, k, v, a, b, A_log, dt_bias, cu: torch.Tensor, pool: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """Exact numerics' delta rule: the recurrence token by token, each token as a decode step computes it
    (`gated_delta_step_`), whatever the chunking or the batch. Shapes as `gated_delta_step_`'s, over the sequences
    at `cu` (T tokens), their states in `pool` at `slots` (updated in place) -> o [T, Hv, Dv] in v's dtype.
    Gradients, where recorded, are the chunked form's (`gated_delta_rule`), recomputed."""
    inputs = (q, k, v, a, b, A_log, dt_bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _ExactDelta.apply(*inputs, cu, pool, slots)
    return _delta_sequences(*inputs, cu, pool, slots)


def _delta_sequences(q, k, v, a, b, A_log, dt_bias, cu, pool, slots):
    if not use_triton(pool) or q.shape[-1] > 256:
        outs = []
        for i, (lo, hi) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
            for t in range(lo, hi):
                outs.append(gated_delta_step_(*(x[t:t + 1] for x in (q, k, v, a, b)), A_log, dt_bias, pool,
                                              slots[i:i + 1]))
        return torch.cat(outs) if outs else v.new_zeros(0, *v.shape[1:])
    return _delta_triton(q, k, v, a, b, A_log, dt_bias, pool, slots, cu)


class _ExactConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu, pool, slots):
        window = pool[slots].clone()  # the windows the sequences start from, for the backward's recompute
        ctx.save_for_backward(x, weight, cu, window)
        return _conv_sequences(x, weight, cu, pool, slots)

    @staticmethod
    def backward(ctx, grad):
        x, weight, cu, window = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x, weight), ctx.needs_input_grad)]
        with torch.enable_grad():
            out, _ = causal_conv(*leaves, cu, window)
            dx, dw = _grad_of((out,), (grad.to(out.dtype),), leaves)
        return dx, dw, None, None, None


class _ExactDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu, pool, slots):
        state = pool[slots].clone()
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, cu, state)
        return _delta_sequences(q, k, v, a, b, A_log, dt_bias, cu, pool, slots)

    @staticmethod
    def backward(ctx, grad):
        *inputs, cu, state = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, ctx.needs_input_grad)]
        with torch.enable_grad():
            q, k, v, a, b, A_log, dt_bias = leaves
            g, beta = gates(a, b, A_log, dt_bias)
            o, _ = gated_delta_rule(q, k, v, g, beta, cu, state)
            wanted = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad(o, wanted, grad.to(o.dtype), allow_unused=True))
        return (*(next(got) if t.requires_grad else None for t in leaves), None, None, None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: rows at any stride, each row's heads packed."""
    return x if x.stride(-1) == 1 and (x.dim() == 2 or x.stride(-2) == x.shape[-1]) else x.contiguous()


def _cu32(cu, device):
    """The kernels' CU as int32 on every path (a decode step's is never read): its pointer type is part of the
    compiled binary, which decode steps and sequences must share."""
    return _unread_cu(device) if cu is None else cu.to(torch.int32)


@functools.cache
def _unread_cu(device: torch.device) -> torch.Tensor:
    """A decode step's CU, one per device: never read, so no decode step allocates one."""
    return torch.empty(1, dtype=torch.int32, device=device)


def _delta_triton(q, k, v, a, b, A_log, dt_bias, pool, slots, cu=None, block_v=None, num_warps=4):
    """`cu` None: one token a sequence (a decode step). `block_v` and `num_warps`: the tile, for
    benchmarks/gated_delta_step.py (a tile changes the bits: decode and sequences must share one)."""
    (hk, dk), (hv, dv), n = q.shape[1:], v.shape[1:], len(slots)
    q, k, v, a, b = (_rows(x) for x in (q, k, v, a, b))
    o = torch.empty(len(v), hv, dv, dtype=v.dtype, device=v.device)
    block_k = next_pow2(dk)
    # a [Dk, BV] tile of the state in registers, no spills
    block_v = block_v or min(next_pow2(dv), max(16, 4096 // block_k))
    _sequences_kernel[(n, hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, pool, slots.long(), _cu32(cu, v.device), o, q.stride(0), k.stride(0),
        v.stride(0), a.stride(0), b.stride(0), hv // hk, dk, dv, hv, dk ** -0.5, L2_EPS, int(cu is None),
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps, enable_fp_fusion=False)
    return o


if HAS_TRITON:
    @triton.jit
    def _conv_token(X, x_offset, W, base, OUT, out_offset, cs, cm, js, k):
        """One token of one sequence, channels `cs`: out = silu(round(sum_j w_j [window, x]_j)); the window at
        `base` (its K - 1 inputs a channel) <- [window[1:], x]."""
        x = tl.load(X + x_offset + cs, mask=cm, other=0.0)
        inside = cm[:, None] & (js[None, :] < k - 1)
        window = tl.load(base + js[None, :], mask=inside, other=0.0).to(tl.float32)  # [C, K-1 padded]
        w = tl.load(W + cs[:, None] * k + js[None, :], mask=inside, other=0.0).to(tl.float32)
        w_last = tl.load(W + cs * k + k - 1, mask=cm, other=0.0).to(tl.float32)
        acc = tl.sum(window * w, 1) + w_last * x.to(tl.float32)
        pre = acc.to(X.dtype.element_ty).to(tl.float32)
        tl.store(OUT + out_offset + cs, (pre / (1.0 + tl.exp(-pre))).to(OUT.dtype.element_ty), mask=cm)
        # shift: position j takes j + 1; the last takes x
        nxt = tl.load(base + js[None, :] + 1, mask=cm[:, None] & (js[None, :] < k - 2), other=0.0)
        last = (js[None, :] == k - 2) & cm[:, None]
        nxt = tl.where(last, x[:, None].to(nxt.dtype), nxt)
        tl.debug_barrier()  # every read of the window before any write
        tl.store(base + js[None, :], nxt.to(base.dtype.element_ty), mask=inside)
        tl.debug_barrier()  # and every write before the next token's reads

    @triton.jit(do_not_specialize=["one_token"])
    def _conv_sequences_kernel(X, W, POOL, SLOTS, CU, OUT, stride_x, c, k, one_token, BLOCK_C: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        """One (sequence, block of channels): its tokens one after another (`_conv_token`), its window in the pool
        at its slot. `one_token` (a decode step): row `seq` is the sequence's one token, and CU is not read. A
        runtime argument, not specialized: decode steps and sequences run one binary (two binaries of this source
        gave decode states apart in the last bits on an H100). Launched without fused multiply-adds
        (enable_fp_fusion=False): a decode step runs the token loop once, a sequence many times, through different
        copies of its body once the compiler has pipelined it, and the copies may fuse differently."""
        seq, cb = tl.program_id(0), tl.program_id(1)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        slot = tl.load(SLOTS + seq).to(tl.int64)
        base = POOL + slot * c * (k - 1) + cs[:, None] * (k - 1)
        start, end = seq, seq + 1
        if one_token == 0:
            start, end = tl.load(CU + seq), tl.load(CU + seq + 1)
        for t in range(start, end):
            _conv_token(X, t * stride_x, W, base, OUT, t * c, cs, cs < c, tl.arange(0, BLOCK_K), k)

    @triton.jit
    def _delta_token(s, Q, K, V, A, B, A_LOG, DT_BIAS, O, q_offset, k_offset, v_offset, a_offset, b_offset,
                     o_offset, h, ks, vs, km, vm, scale, eps):
        """One token of one value head on the state tile s [Dk, BV] (fp32): S <- e^g S; u = beta (v - S^T k);
        S += k u^T; o = S^T q, with q and k L2-normalised in fp32 and q scaled, g and beta as `gates` computes
        them. Returns the new tile."""
        qv = tl.load(Q + q_offset + ks, mask=km, other=0.0).to(tl.float32)
        kv = tl.load(K + k_offset + ks, mask=km, other=0.0).to(tl.float32)
        qv = qv / tl.sqrt(tl.sum(qv * qv, 0) + eps) * scale
        kv = kv / tl.sqrt(tl.sum(kv * kv, 0) + eps)
        vv = tl.load(V + v_offset + vs, mask=vm, other=0.0).to(tl.float32)
        x = tl.load(A + a_offset + h).to(tl.float32) + tl.load(DT_BIAS + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold
        decay = tl.exp(-tl.exp(tl.load(A_LOG + h).to(tl.float32)) * softplus)
        bl = tl.load(B + b_offset + h)
        beta = (1.0 / (1.0 + tl.exp(-bl.to(tl.float32)))).to(bl.dtype).to(tl.float32)
        s = s * decay
        u = beta * (vv - tl.sum(s * kv[:, None], 0))
        s = s + kv[:, None] * u[None, :]
        out = tl.sum(s * qv[:, None], 0)
        tl.store(O + o_offset + vs, out.to(O.dtype.element_ty), mask=vm)
        return s

    @triton.jit(do_not_specialize=["one_token"])
    def _sequences_kernel(Q, K, V, A, B, A_LOG, DT_BIAS, POOL, SLOTS, CU, O, stride_q, stride_k, stride_v, stride_a,
                          stride_b, group, dk, dv, hv, scale, eps, one_token, BLOCK_K: tl.constexpr,
                          BLOCK_V: tl.constexpr):
        """One (sequence, value head, block of value dims): its tokens one after another (`_delta_token`), the state
        in registers between them and in the pool at its slot before and after. `one_token` (a decode step): row
        `seq` is the sequence's one token, and CU is not read; runtime, not specialized, and launched without fused
        multiply-adds, as the convolution's."""
        seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ks = tl.arange(0, BLOCK_K)
        vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        km, vm = ks < dk, vs < dv
        slot = tl.load(SLOTS + seq).to(tl.int64)
        ptr = POOL + (slot * hv + h) * dk * dv + ks[:, None] * dv + vs[None, :]
        s = tl.load(ptr, mask=km[:, None] & vm[None, :], other=0.0).to(tl.float32)
        start, end = seq, seq + 1
        if one_token == 0:
            start, end = tl.load(CU + seq), tl.load(CU + seq + 1)
        for t in range(start, end):
            s = _delta_token(s, Q, K, V, A, B, A_LOG, DT_BIAS, O, t * stride_q + (h // group) * dk,
                             t * stride_k + (h // group) * dk, t * stride_v + h * dv, t * stride_a, t * stride_b,
                             (t * hv + h) * dv, h, ks, vs, km, vm, scale, eps)
        tl.store(ptr, s.to(POOL.dtype.element_ty), mask=km[:, None] & vm[None, :])
