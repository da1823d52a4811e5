"""Qwen2/2.5 (q/k/v bias, no o bias), Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (Qwen3's attention, mixture-of-experts
MLPs: `rlcu/models/moe.py`)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False))
register(ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm="head"))
register(ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head"))
