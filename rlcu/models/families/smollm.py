"""SmolLM3: Llama's layers with RoPE left out of every fourth layer (NoPE, the config's `no_rope_layers`)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("smollm3", "SmolLM3ForCausalLM"))
