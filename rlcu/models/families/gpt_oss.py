"""gpt-oss (20b, 120b): attention with sinks and biases, sliding-window (128) layers alternating with full ones, YaRN
RoPE, and mixture-of-experts MLPs in every layer whose router and experts carry biases, with a clamped SwiGLU
(`rlcu/models/moe.py`). The router's softmax over its top-k logits is the renormalised top-k of the softmax
(`norm_topk_prob`).

The checkpoint keeps each layer's experts stacked and transposed (`gate_up_proj` [E, H, 2I] with gate and up
columns interleaved, `down_proj` [E, I, H]); released checkpoints store those two in MXFP4 (`_blocks` and
`_scales`), dequantised here on load (`mxfp4.py`). Export writes them back in bf16 or the model's dtype."""
from __future__ import annotations

import torch

from rlcu.models.mxfp4 import dequantize_experts
from rlcu.models.spec import ArchSpec, register

ROUTER = {"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias"}


def _load(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    state = dequantize_experts(state)
    out = {}
    for key, value in state.items():
        for theirs, ours in ROUTER.items():
            if key.endswith("." + theirs):
                key = key[:-len(theirs)] + ours
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I], gate and up interleaved -> [E, 2I, H]
            value = torch.cat([value[..., ::2], value[..., 1::2]], dim=-1).transpose(1, 2)
        elif key.endswith("mlp.experts.gate_up_proj_bias"):
            value = torch.cat([value[..., ::2], value[..., 1::2]], dim=-1)
        elif key.endswith("mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
            value = value.transpose(1, 2)
        out[key] = value
    return out


def _interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate half then up half -> gate and up columns alternating."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _save(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for theirs, ours in ROUTER.items():
            if key.endswith("." + ours):
                key = key[:-len(ours)] + theirs
        if key.endswith("mlp.experts.gate_up_proj"):
            value = _interleave(value.transpose(1, 2))
        elif key.endswith("mlp.experts.gate_up_proj_bias"):
            value = _interleave(value)
        elif key.endswith("mlp.experts.down_proj"):
            value = value.transpose(1, 2)
        out[key] = value
    return out


register(ArchSpec("gpt_oss", "GptOssForCausalLM", attention_sinks=True, moe_bias=True,
                  expert_activation="clamped_swiglu", experts_interleaved=True, hf_fused=("experts",),
                  read=lambda hf: {"norm_topk_prob": True}, load_weights=_load, save_weights=_save))
