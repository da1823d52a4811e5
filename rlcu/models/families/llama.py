"""Llama (SmolLM2, Llama 3, DeepSeek-R1-Distill-Llama): the spec every other family varies."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("llama", "LlamaForCausalLM"))
