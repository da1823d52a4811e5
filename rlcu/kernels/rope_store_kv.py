"""RoPE on queries and keys and the paged KV-cache write, in one kernel: the engine's step rotates q,
rotates k straight into its cache slot and copies v beside it, instead of three launches (rope q,
rope k, store) and a rotated-k tensor that is written once and read once. Rounds as `rope_reference`."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton
from rlcu.kernels.kv_cache import store_kv_reference
from rlcu.kernels.rope import rope_reference


def rope_store_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D], cos/sin: [T, D]; caches [blocks, block_size, Hkv, D]; slots [T]
    (negative: write nothing). Returns the rotated q."""
    c, s = cos[:, None], sin[:, None]
    store_kv_reference(rope_reference(k, c, s), v, k_cache, v_cache, slots)
    return rope_reference(q, c, s)


if HAS_TRITON:
    @triton.jit
    def _rotate(row, c1, c2, s1, s2, HALF: tl.constexpr):
        d = tl.arange(0, HALF)
        x1 = tl.load(row + d)
        x2 = tl.load(row + HALF + d)
        dt = row.dtype.element_ty
        o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)  # each product rounds to x's dtype first, as in torch
        o2 = ((x2 * c2).to(dt) + (x1 * s2).to(dt)).to(dt)
        return o1, o2

    @triton.jit
    def _rope_store_kv_kernel(Q, K, V, COS, SIN, Q_OUT, KC, VC, slots, stride_qt, stride_qh, stride_kt, stride_kh,
                              stride_vt, stride_vh, stride_ct, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)  # heads 0..HQ-1 are queries, the rest key/value heads
        d = tl.arange(0, HALF)
        c1 = tl.load(COS + t * stride_ct + d)
        c2 = tl.load(COS + t * stride_ct + HALF + d)
        s1 = tl.load(SIN + t * stride_ct + d)
        s2 = tl.load(SIN + t * stride_ct + HALF + d)
        if h < HQ:
            o1, o2 = _rotate(Q + t * stride_qt + h * stride_qh, c1, c2, s1, s2, HALF)
            out = Q_OUT + (t * HQ + h) * 2 * HALF
            tl.store(out + d, o1)
            tl.store(out + HALF + d, o2)
        else:
            slot = tl.load(slots + t)
            if slot >= 0:
                j = h - HQ
                o1, o2 = _rotate(K + t * stride_kt + j * stride_kh, c1, c2, s1, s2, HALF)
                dst = (slot * HKV + j) * 2 * HALF
                tl.store(KC + dst + d, o1.to(KC.dtype.element_ty))
                tl.store(KC + dst + HALF + d, o2.to(KC.dtype.element_ty))
                v_row = V + t * stride_vt + j * stride_vh
                tl.store(VC + dst + d, tl.load(v_row + d).to(VC.dtype.element_ty))
                tl.store(VC + dst + HALF + d, tl.load(v_row + HALF + d).to(VC.dtype.element_ty))


def rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    _rope_store_kv_kernel[(t, hq + hkv)](q, k, v, cos, sin, q_out, k_cache, v_cache, slots, q.stride(0), q.stride(1),
                                         k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
                                         HQ=hq, HKV=hkv, HALF=d // 2)
    return q_out


def supported(head_dim: int) -> bool:
    return head_dim // 2 == next_pow2(head_dim // 2)


def rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """Triton on CUDA (power-of-two half head_dim); the reference otherwise."""
    if use_triton(q) and supported(q.shape[-1]):
        return rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    return rope_store_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots)
