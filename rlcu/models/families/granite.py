"""Granite 3: Llama's layers with four multipliers (embeddings, residual branches, attention scale, logits)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("granite", "GraniteForCausalLM"))
