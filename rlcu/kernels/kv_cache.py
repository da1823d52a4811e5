"""Write new keys and values into the paged KV cache at flat slots (block * block_size + offset).
A negative slot is skipped: the padding rows of a CUDA-graph batch write nowhere. The engine's Triton
path does this inside `rope_store_kv`; this is the reference it is tested against."""
from __future__ import annotations

import torch


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
