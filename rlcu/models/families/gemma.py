"""Gemma 3: `1 + w` RMSNorms before and after attention and the MLP, GeGLU, per-head q/k norms, embeddings
scaled by sqrt(hidden_size), attention scaled by `query_pre_attn_scalar`, and five sliding-window layers (local
RoPE base) to one full layer. `gemma3` checkpoints (vision + language) load their language model alone."""
from rlcu.models.spec import ArchSpec, register

GEMMA3 = dict(norm="sandwich", norm_offset=1.0, activation="gelu_tanh", qk_norm="head", embed_scale="sqrt_hidden")

register(ArchSpec("gemma3_text", "Gemma3ForCausalLM", **GEMMA3))
register(ArchSpec("gemma3", "Gemma3ForCausalLM", **GEMMA3, text_config="text_config", export_as="gemma3_text",
                  weight_prefixes={"model.language_model.": "model."},
                  ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector.")))
