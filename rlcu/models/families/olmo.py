"""OLMo 2 and 3: norms after attention and after the MLP only, q/k RMSNorm over the whole projection;
OLMo 3 alternates sliding-window and full layers."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("olmo2", "Olmo2ForCausalLM", norm="post", qk_norm="full"))
register(ArchSpec("olmo3", "Olmo3ForCausalLM", norm="post", qk_norm="full"))
