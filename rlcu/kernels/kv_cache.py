"""Write new keys and values into the paged KV cache at flat slots (block * block_size + offset).
A negative slot is skipped: the padding rows of a CUDA-graph batch write nowhere."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, next_pow2, tl, triton, use_triton


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


if HAS_TRITON:
    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, N: tl.constexpr, N_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slots + t)
        offs = tl.arange(0, N_PAD)
        mask = offs < tl.where(slot >= 0, N, 0)
        k = tl.load(K + t * stride_kt + offs, mask=mask)
        v = tl.load(V + t * stride_vt + offs, mask=mask)
        tl.store(KC + slot * N + offs, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + slot * N + offs, v.to(VC.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    t, h, d = k.shape
    k, v = k.reshape(t, h * d), v.reshape(t, h * d)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), h * d, next_pow2(h * d))


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    (store_kv_triton if use_triton(k) else store_kv_reference)(k, v, k_cache, v_cache, slot_mapping)
