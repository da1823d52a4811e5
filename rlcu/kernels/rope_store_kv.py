"""RoPE on queries and keys and the paged KV-cache write, in one kernel: the engine's step rotates q,
rotates k straight into its cache slot and copies v beside it, instead of three launches (rope q,
rope k, store) and a rotated-k tensor that is written once and read once. Rounds as `rope_reference`.

Qwen3's and Gemma 3's per-head RMSNorm of q and k (`q_weight`, `k_weight`, `offset` 1.0 for Gemma's 1 + w) is
applied in the same pass, rounded as `rms_norm_reference`: two launches per layer fewer, which at a decode step of
a 28-layer model is 56 of its roughly 300 kernels (they are launch-bound at any batch size).

An FP8 cache gets k and v saturated and rounded as `kv_cache.to_cache` does (kv_cache.py)."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton
from rlcu.kernels.kv_cache import FP8, round_e4m3, store_kv_reference
from rlcu.kernels.rmsnorm import rms_norm_reference
from rlcu.kernels.rope import rope_reference


def rope_store_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight=None, k_weight=None,
                            eps: float = 0.0, offset: float = 0.0) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D], cos/sin: [T, D]; caches [blocks, block_size, Hkv, D]; slots [T]
    (negative: write nothing); q_weight/k_weight [D]: RMSNorm each head of q/k first. Returns the rotated q."""
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps, offset=offset), rms_norm_reference(k, k_weight, eps, offset=offset)
    c, s = cos[:, None], sin[:, None]
    store_kv_reference(rope_reference(k, c, s), v, k_cache, v_cache, slots)
    return rope_reference(q, c, s)


if HAS_TRITON:
    @triton.jit
    def _rotate(X, stride_h, heads, hmask, c1, c2, s1, s2, W, eps, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                NORM: tl.constexpr, OFFSET: tl.constexpr):
        """The rotated dims of heads `heads` of one token as [heads, HALF_PAD] halves, each head RMS-normalised on its
        own first when NORM (whole heads only: no dims pass through), then rotated."""
        d = tl.arange(0, HALF_PAD)
        m = hmask[:, None] & (d < HALF)[None, :]
        row = X + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(row, mask=m, other=0.0)
        x2 = tl.load(row + HALF, mask=m, other=0.0)
        dt = X.dtype.element_ty
        if NORM:  # rounded as rms_norm: the normalised row to x's dtype, then times the weight (Gemma: one rounding)
            h1, h2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(h1 * h1, 1) + tl.sum(h2 * h2, 1)) / (2 * HALF) + eps)
            w1 = tl.load(W + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
            if OFFSET != 0.0:
                x1 = (h1 * rstd[:, None] * (OFFSET + w1)).to(dt)
                x2 = (h2 * rstd[:, None] * (OFFSET + w2)).to(dt)
            else:
                x1 = ((h1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt)
                x2 = ((h2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt)
        # each product rounds to x's dtype first, as in torch
        o1 = ((x1 * c1[None, :]).to(dt) + (-x2 * s1[None, :]).to(dt)).to(dt)
        o2 = ((x2 * c2[None, :]).to(dt) + (x1 * s2[None, :]).to(dt)).to(dt)
        return o1, o2

    @triton.jit
    def _to_cache(x, CACHE, FP8_CACHE: tl.constexpr):
        if FP8_CACHE:  # rounded and saturated before the cast (kv_cache.py)
            x = round_e4m3(x)
        return x.to(CACHE.dtype.element_ty)

    @triton.jit
    def _rope_store_kv_kernel(Q, K, V, COS, SIN, Q_OUT, KC, VC, slots, QW, KW, eps, stride_qt, stride_qh, stride_kt,
                              stride_kh, stride_vt, stride_vh, stride_ct, HQ: tl.constexpr, HKV: tl.constexpr,
                              HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                              HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, V_PAD: tl.constexpr, NORM: tl.constexpr,
                              FP8_CACHE: tl.constexpr, OFFSET: tl.constexpr):
        """Program (t, 0) rotates token t's query heads, (t, 1) its key heads into the cache, with v beside them:
        a program per token and head was 12,288 programs of 128 elements at a 512-sequence decode step. Dims past
        the rotated 2 * HALF (partial rotary) are copied as they are."""
        t = tl.program_id(0)
        d = tl.arange(0, HALF_PAD)
        dm = d < HALF
        c1 = tl.load(COS + t * stride_ct + d, mask=dm, other=0.0)
        c2 = tl.load(COS + t * stride_ct + HALF + d, mask=dm, other=0.0)
        s1 = tl.load(SIN + t * stride_ct + d, mask=dm, other=0.0)
        s2 = tl.load(SIN + t * stride_ct + HALF + d, mask=dm, other=0.0)
        if tl.program_id(1) == 0:
            heads = tl.arange(0, HQ_PAD)
            hmask = heads < HQ
            o1, o2 = _rotate(Q + t * stride_qt, stride_qh, heads, hmask, c1, c2, s1, s2, QW, eps, HALF, HALF_PAD, NORM,
                             OFFSET)
            out = Q_OUT + (t * HQ + heads[:, None]) * HEAD_DIM
            m = hmask[:, None] & dm[None, :]
            tl.store(out + d[None, :], o1, mask=m)
            tl.store(out + HALF + d[None, :], o2, mask=m)
            if PASS_PAD > 0:  # the dims past the rotated ones
                e = 2 * HALF + tl.arange(0, PASS_PAD)
                pm = hmask[:, None] & (e < HEAD_DIM)[None, :]
                x = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + e[None, :], mask=pm, other=0.0)
                tl.store(out + e[None, :], x, mask=pm)
        else:
            slot = tl.load(slots + t)
            if slot >= 0:
                heads = tl.arange(0, HKV_PAD)
                hmask = heads < HKV
                o1, o2 = _rotate(K + t * stride_kt, stride_kh, heads, hmask, c1, c2, s1, s2, KW, eps, HALF, HALF_PAD,
                                 NORM, OFFSET)
                dst = (slot * HKV + heads[:, None]) * HEAD_DIM
                m = hmask[:, None] & dm[None, :]
                tl.store(KC + dst + d[None, :], _to_cache(o1, KC, FP8_CACHE), mask=m)
                tl.store(KC + dst + HALF + d[None, :], _to_cache(o2, KC, FP8_CACHE), mask=m)
                if PASS_PAD > 0:
                    e = 2 * HALF + tl.arange(0, PASS_PAD)
                    pm = hmask[:, None] & (e < HEAD_DIM)[None, :]
                    x = tl.load(K + t * stride_kt + heads[:, None] * stride_kh + e[None, :], mask=pm, other=0.0)
                    tl.store(KC + dst + e[None, :], _to_cache(x, KC, FP8_CACHE), mask=pm)
                f = tl.arange(0, V_PAD)  # all of v, in one pass
                vm = hmask[:, None] & (f < HEAD_DIM)[None, :]
                v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + f[None, :], mask=vm, other=0.0)
                tl.store(VC + dst + f[None, :], _to_cache(v, VC, FP8_CACHE), mask=vm)


def rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight=None, k_weight=None,
                         eps: float = 0.0, offset: float = 0.0) -> torch.Tensor:
    """cos/sin [T, R]: R < D rotates each head's first R dims and copies the rest (partial rotary)."""
    t, hq, d = q.shape
    hkv, r = k.shape[1], cos.shape[-1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride() and r % 2 == 0 and r <= d
    norm = q_weight is not None
    assert not norm or r == d, "the fused q/k norms need the whole head rotated"
    # the fused norm rounds once, to q's dtype: a wider weight (fp32 under autocast) would promote Llama's product
    # (Gemma's form rounds to q's dtype whatever the weight's)
    assert not norm or offset or q_weight.dtype == k_weight.dtype == q.dtype, "q/k norm weights in q's dtype only"
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    _rope_store_kv_kernel[(t, 2)](q, k, v, cos, sin, q_out, k_cache, v_cache, slots,
                                  q_weight if norm else q, k_weight if norm else k, eps,
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  cos.stride(0), HQ=hq, HKV=hkv, HQ_PAD=next_pow2(hq), HKV_PAD=next_pow2(hkv),
                                  HEAD_DIM=d, HALF=r // 2, HALF_PAD=next_pow2(r // 2),
                                  PASS_PAD=0 if r == d else next_pow2(d - r), V_PAD=next_pow2(d), NORM=norm,
                                  FP8_CACHE=k_cache.dtype == FP8, OFFSET=float(offset))
    return q_out


def supported(head_dim: int) -> bool:
    return head_dim // 2 == next_pow2(head_dim // 2)


def rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight=None, k_weight=None, eps: float = 0.0,
                  offset: float = 0.0):
    """Triton on CUDA (power-of-two half head_dim); the reference otherwise."""
    if use_triton(q) and supported(q.shape[-1]):
        return rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset)
    return rope_store_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset)
