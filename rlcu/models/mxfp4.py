"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: blocks of 32 values share one scale.
`dequantize` turns a checkpoint's `{name}_blocks` [..., G, 16] (two e2m1 values a byte, the low nibble first) and
`{name}_scales` [..., G] (e8m0: the block's power of two, biased by 127) into [..., G * 32] values."""
from __future__ import annotations

import torch

# the sixteen e2m1 codes: sign bit, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not pair: want uint8 blocks [..., G, 16] and uint8 scales [..., G]")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype, device=blocks.device)
    for i in range(blocks.shape[0]):  # one expert at a time: the index tensors are 8 bytes a value
        b = blocks[i]
        values = torch.stack([lut[(b & 15).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)
        # e8m0 is a power of two, which float32 holds exactly: the product rounds once, to `dtype`
        out[i] = torch.ldexp(values, scales[i].to(torch.int32)[..., None] - 127).to(dtype)
    return out.flatten(-2)


def dequantize_experts(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every `{name}_blocks` / `{name}_scales` pair of a gpt-oss checkpoint ([E, N, G, 16] / [E, N, G]) -> `name`
    [E, K, N] in `dtype`, laid out as the checkpoint's unquantised experts are; other tensors unchanged."""
    state = dict(state)
    for key in [k for k in state if k.endswith("_blocks")]:
        name = key[:-len("_blocks")]
        if name + "_scales" not in state:
            raise ValueError(f"{key} has no {name}_scales: the MXFP4 checkpoint is incomplete")
        try:
            state[name] = dequantize(state.pop(key), state.pop(name + "_scales"), dtype).transpose(1, 2)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return state
