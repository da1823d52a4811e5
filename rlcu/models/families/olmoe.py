"""OLMoE: OLMo 2's q/k RMSNorm over the whole projection, pre-norm layers, and mixture-of-experts MLPs in every layer
(`rlcu/models/moe.py`)."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("olmoe", "OlmoeForCausalLM", qk_norm="full"))
