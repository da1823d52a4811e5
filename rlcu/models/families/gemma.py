"""Gemma 3: `1 + w` RMSNorms before and after attention and the MLP, GeGLU, per-head q/k norms, embeddings
scaled by sqrt(hidden_size), attention scaled by `query_pre_attn_scalar`, and five sliding-window layers (local
RoPE base) to one full layer. `gemma3` checkpoints (vision + language) load their language model alone.

Gemma 2: the same layers without q/k norms, sliding and full layers taking turns on one RoPE base, attention
scores and final logits soft-capped (the config's `attn_logit_softcapping` and `final_logit_softcapping`)."""
from rlcu.models.spec import ArchSpec, register

GEMMA = dict(norm="sandwich", norm_offset=1.0, activation="gelu_tanh", embed_scale="sqrt_hidden")
GEMMA3 = dict(GEMMA, qk_norm="head")

register(ArchSpec("gemma2", "Gemma2ForCausalLM", **GEMMA))

register(ArchSpec("gemma3_text", "Gemma3ForCausalLM", **GEMMA3))
register(ArchSpec("gemma3", "Gemma3ForCausalLM", **GEMMA3, text_config="text_config", export_as="gemma3_text",
                  weight_prefixes={"model.language_model.": "model."},
                  ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector.")))
