"""Phi-3 and Phi-4-mini: q/k/v and gate/up stored fused in the checkpoint, partial rotary, a sliding window
where the config sets one."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("phi3", "Phi3ForCausalLM", sliding="all", hf_fused=("qkv_proj", "gate_up_proj")))
