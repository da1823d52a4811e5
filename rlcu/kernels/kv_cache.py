"""Write new keys and values into the paged KV cache at flat slots (block * block_size + offset).
A negative slot is skipped: the padding rows of a CUDA-graph batch write nowhere. The engine's Triton
path does this inside `rope_store_kv`; this is the reference it is tested against.

An FP8 cache (`float8_e4m3fn`, the engine's `kv_cache_dtype: fp8`) holds each value rounded to nearest
with unit scale, saturated at +-448 (the format's largest finite value) rather than turned into NaN.
The Triton kernels that write it round in integer arithmetic (`round_e4m3`) before the cast, so that the
cast only meets exact values: the same on the GPU and under the CPU interpreter, whose own float-to-FP8
conversion truncates where rounding up crosses a power of two."""
from __future__ import annotations

import torch

from rlcu.kernels._triton import HAS_TRITON, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it (FP8: saturated first)."""
    return (x.float().clamp(-FP8_MAX, FP8_MAX) if cache_dtype == FP8 else x).to(cache_dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte cache's view that every indexing op accepts (float8 has no index_copy_ kernel on the CPU);
    whole rows copy the same either way."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for x, cache in ((k, k_cache), (v, v_cache)):
        rows = as_bytes(cache).view(-1, *cache.shape[2:])
        rows.index_copy_(0, slot_mapping, as_bytes(to_cache(x, cache.dtype)))


if HAS_TRITON:
    @triton.jit
    def round_e4m3(x):
        """fp32 -> the nearest e4m3 value (ties to even), saturated at +-448, still as fp32: normal e4m3 keeps 3
        of fp32's 23 mantissa bits; below 2^-6 (subnormal) the grid is 2^-9, one bit fewer per binade."""
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        drop = 20 + tl.minimum(tl.maximum(-6 - exponent, 0), 3)  # mantissa bits rounded away: 20..23
        keep_odd = tl.where(drop == 23, 1, (bits >> drop) & 1)  # the last bit kept (at 23: the implicit 1)
        bits = (bits + ((1 << (drop - 1)) - 1) + keep_odd) & ~((1 << drop) - 1)  # a carry moves the exponent up
        rounded = bits.to(tl.float32, bitcast=True)
        # under 2^-9: 0 or the smallest subnormal, 2^-9 (a tie at 2^-10 goes to 0, the even one)
        tiny = tl.where(tl.abs(x) > 0.0009765625, 0.001953125, 0.0).to(tl.int32, bitcast=True)
        tiny = (tiny | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign bit, so -0 stays -0
        return tl.where(exponent < -9, tiny, rounded)
