"""Mixture-of-experts routing, dispatch and combine.

Routing: the router's softmax (fp32), its k largest probabilities, renormalised or not. The reference is
PyTorch's ops (the trainer's, differentiable); the kernel, one launch for all of a decode step's tokens, serves the
default mode's sampler, whose probabilities round as a fused softmax does (not the reference's bits: exact mode
keeps the reference on both sides).

Dispatch: the (token, slot) pairs of a router's picks sorted by expert, stably (tokens ascending within an
expert), with each expert's count and the counts' cumulative ends. The order is defined by the picks alone, so
any way of computing it gives the same rows in the same places: the reference is torch's stable argsort (a radix
sort: several launches) and a bincount; the kernel computes, in one launch of a program per block of experts, where
each of the block's pairs goes (its expert's start plus the pairs of that expert before it), for the up to a few
thousand pairs of a decode step. Larger batches (a training forward) take the reference.

Combine: each token's output, the sum of its k experts' rows weighted by the router, taken in slot order and
rounded where PyTorch's unfused ops round (each product, then each partial sum, in the promoted dtype): the kernel
gives the reference's bits, in one launch where the reference takes 2k, so forwards that record no gradient take it
while differentiable ones take the reference (exact mode needs the two equal: a GPU test checks it)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton

MAX_PAIRS = 4096  # each program holds every pair in registers; a training batch's sort takes the reference
_CELLS = 4096  # pairs x experts a program compares: its block of experts is _CELLS // pairs wide


class Dispatch(NamedTuple):
    """order [P] int64: the pairs (token * k + slot) sorted by expert; positions [P] int64: where each pair went
    (order's inverse); tokens [P] int64: each sorted row's token (order // k); counts [G] int64; ends [G] int32,
    the cumulative counts (a grouped GEMM's offsets)."""
    order: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    ends: torch.Tensor


def dispatch_reference(experts: torch.Tensor, groups: int) -> Dispatch:
    """experts [T, k] (each token's picks, in slot order) -> `Dispatch`."""
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(groups, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    positions = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=order.device))
    return Dispatch(order, positions, order // experts.shape[-1], counts, counts.cumsum(0, dtype=torch.int32))


def route_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, experts [T, k]): softmax in fp32, the k
    largest, renormalised to sum to 1 when `normalize` (Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def combine_reference(y: torch.Tensor, d: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """y [P, H] (the experts' rows in `d`'s order), weights [T, k] -> [T, H]: slot 0's weighted row, then each next
    slot's added (a fixed order: a token's output does not depend on its batch). Differentiable: the rows go back to
    their pairs by a copy, whose backward is a gather (an indexed read's would be a sorted scatter-add)."""
    t, k = weights.shape
    per_slot = torch.empty_like(y).index_copy_(0, d.order, y).view(t, k, -1)
    out = per_slot[:, 0] * weights[:, :1]
    for j in range(1, k):
        out = out + per_slot[:, j] * weights[:, j:j + 1]
    return out


if HAS_TRITON:
    @triton.jit
    def _dispatch_kernel(E, ORDER, POSITIONS, TOKENS, COUNTS, ENDS, P, G, SLOTS, BLOCK_P: tl.constexpr,
                         BLOCK_G: tl.constexpr):
        # a program per block of experts: pair p of the block goes to start[e_p] + (pairs before p with the same
        # expert), start the pairs of lower experts (counted over all pairs) plus the block's counts scanned
        ps = tl.arange(0, BLOCK_P)
        e = tl.load(E + ps, mask=ps < P, other=-1).to(tl.int32)  # the picks as the router gave them (int64)
        g0 = tl.program_id(0) * BLOCK_G
        gs = g0 + tl.arange(0, BLOCK_G)
        hot = (e[:, None] == gs[None, :]).to(tl.int32)
        counts = tl.sum(hot, 0)
        ends = tl.sum(((e >= 0) & (e < g0)).to(tl.int32), 0) + tl.cumsum(counts, 0)
        rank = tl.cumsum(hot, 0) - 1 + (ends - counts)[None, :]
        dest = tl.sum(tl.where(hot != 0, rank, 0), 1)
        mine = (e >= g0) & (e < g0 + BLOCK_G)
        tl.store(COUNTS + gs, counts.to(tl.int64), mask=gs < G)
        tl.store(ENDS + gs, ends, mask=gs < G)
        tl.store(ORDER + dest, ps.to(tl.int64), mask=mine)
        tl.store(POSITIONS + ps, dest.to(tl.int64), mask=mine)
        tl.store(TOKENS + dest, (ps // SLOTS).to(tl.int64), mask=mine)

    @triton.jit
    def _route_kernel(LOGITS, WEIGHTS, EXPERTS, T, E, stride_t, K: tl.constexpr, NORMALIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        es = tl.arange(0, BLOCK_E)
        rows = tl.minimum(ts, T - 1)  # past the last token: its row again (never stored)
        x = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_t + es[None, :], mask=es[None, :] < E,
                    other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 1)[:, None])
        probs = p / tl.sum(p, 1)[:, None]
        probs = tl.where(es[None, :] < E, probs, -1.0)
        ks = tl.arange(0, BLOCK_K)
        picked = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        which = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for j in tl.static_range(K):  # the largest left, the lowest index among equals, then taken out
            best = tl.max(probs, 1)
            # a row of NaNs (a diverged model) matches nothing: an expert of the model all the same, never past them
            idx = tl.minimum(tl.min(tl.where(probs == best[:, None], es[None, :], BLOCK_E), 1), E - 1)
            picked = tl.where(ks[None, :] == j, best[:, None], picked)
            which = tl.where(ks[None, :] == j, idx[:, None], which)
            probs = tl.where(es[None, :] == idx[:, None], -2.0, probs)
        if NORMALIZE:
            picked = picked / tl.sum(picked, 1)[:, None]
        out = ts[:, None] * K + ks[None, :]
        inside = (ts[:, None] < T) & (ks[None, :] < K)
        tl.store(WEIGHTS + out, picked.to(WEIGHTS.dtype.element_ty), mask=inside)
        tl.store(EXPERTS + out, which.to(tl.int64), mask=inside)

    @triton.jit
    def _combine_kernel(Y, POSITIONS, W, OUT, H, stride_y, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        inside = cols < H
        dt = OUT.dtype.element_ty
        for j in tl.static_range(SLOTS):
            row = tl.load(POSITIONS + t * SLOTS + j)
            w = tl.load(W + t * SLOTS + j).to(tl.float32)
            y = tl.load(Y + row * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
            term = (y * w).to(dt)  # rounded as the unfused product is (fusion is off at launch)
            if j == 0:
                out = term
            else:
                out = (out.to(tl.float32) + term.to(tl.float32)).to(dt)
        tl.store(OUT + t.to(tl.int64) * H + cols, out, mask=inside)


def dispatch(experts: torch.Tensor, groups: int) -> Dispatch:
    """`dispatch_reference`'s result (the same integers): one launch for a decode step's few pairs, on the device
    (CUDA-graph safe, no host read), the reference beyond `MAX_PAIRS` or without Triton."""
    p = experts.numel()
    if not use_triton(experts) or p > MAX_PAIRS or p == 0:
        return dispatch_reference(experts, groups)
    flat = experts.reshape(-1)
    dev = experts.device
    order, positions, tokens = (torch.empty(p, dtype=torch.int64, device=dev) for _ in range(3))
    counts = torch.empty(groups, dtype=torch.int64, device=dev)
    ends = torch.empty(groups, dtype=torch.int32, device=dev)
    block_p = next_pow2(p)
    block_g = max(1, min(next_pow2(groups), _CELLS // block_p))
    _dispatch_kernel[(triton.cdiv(groups, block_g),)](flat, order, positions, tokens, counts, ends, p, groups,
                                                      experts.shape[-1], BLOCK_P=block_p, BLOCK_G=block_g,
                                                      num_warps=8 if block_p >= 1024 else 4)
    return Dispatch(order, positions, tokens, counts, ends)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`'s picks in one launch, rounded as a fused softmax rounds, where no gradient is recorded
    through them and the router has at most 256 experts; the reference otherwise. Which forwards may take it is the
    caller's choice (`SparseMoE`: the engine's, in the default mode)."""
    t, e = logits.shape
    if (torch.is_grad_enabled() and logits.requires_grad) or not use_triton(logits) or e > 256 or not t \
            or logits.stride(-1) != 1:
        return route_reference(logits, top_k, normalize)
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    block_e = next_pow2(e)
    block_t = max(1, min(16, 2048 // block_e))
    _route_kernel[(triton.cdiv(t, block_t),)](logits, weights, experts, t, e, logits.stride(0), K=top_k,
                                              NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
                                              BLOCK_K=next_pow2(top_k))
    return weights, experts


def combine(y: torch.Tensor, d: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """`combine_reference`'s bits in one launch (reading each pair's row at `d.positions`) where no gradient is
    recorded through it; the reference otherwise, or without Triton."""
    needs_grad = torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad)
    if needs_grad or not use_triton(y) or y.stride(-1) != 1:
        return combine_reference(y, d, weights)
    t, k = weights.shape
    h = y.shape[-1]
    out = torch.empty(t, h, dtype=torch.promote_types(y.dtype, weights.dtype), device=y.device)
    if t:
        block = min(1024, next_pow2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](y, d.positions, weights.contiguous(), out, h, y.stride(0),
                                                     SLOTS=k, BLOCK_H=block, enable_fp_fusion=False)
    return out
