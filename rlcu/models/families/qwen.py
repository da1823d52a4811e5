"""Qwen2/2.5 (q/k/v bias, no o bias) and Qwen3 (per-head q/k RMSNorm)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False))
register(ArchSpec("qwen3", "Qwen3ForCausalLM", qk_norm="head"))
