"""Attention of variable-length query chunks over the paged KV cache, causal, after any cached prefix:
query i of a sequence with context length L and q_len n sits at position L - n + i and sees keys
0 .. L - n + i. Prefill chunks and decode tokens of one engine step go through here together."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q: [T, Hq, D] (sequences concatenated); caches: [num_blocks, block_size, Hkv, D];
    cu_seqlens_q: [S + 1]; context_lens: [S] (keys per sequence, this step's included);
    block_tables: [S, max_blocks]. Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for s in range(len(ctx)):
        start, end, n_ctx = cu[s], cu[s + 1], ctx[s]
        if end == start:
            continue
        blocks = block_tables[s, :-(-n_ctx // bs)]
        k = k_cache[blocks].flatten(0, 1)[:n_ctx]
        v = v_cache[blocks].flatten(0, 1)[:n_ctx]
        n = end - start
        q_pos = torch.arange(n_ctx - n, n_ctx, device=q.device)[:, None]
        mask = torch.arange(n_ctx, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                           v.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    return paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
