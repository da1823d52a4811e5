"""Mistral and Ministral: Llama's layers with a sliding window on every layer where the config sets one."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("mistral", "MistralForCausalLM", sliding="all"))
