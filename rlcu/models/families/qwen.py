"""Qwen2/2.5 (q/k/v bias, no o bias), Qwen2-MoE (with a shared expert), Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE
(Qwen3's attention, mixture-of-experts MLPs: `rlcu/models/moe.py`)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False))
register(ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm="head"))
register(ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head"))
# Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (its config names the q/k/v bias `qkv_bias`), routed experts beside a
# shared expert
register(ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", o_bias=False,
                  read=lambda hf: {"qkv_bias": bool(hf.get("qkv_bias", True))}))
