"""Qwen3.5: three Gated DeltaNet layers (linear attention, `rlcu/models/linear_attention.py`) to one full-attention
layer, whose q_proj also projects an output gate and whose RoPE covers a quarter of each head; `1 + w` RMSNorms
(the gated norm inside DeltaNet scales by w). A `qwen3_5` checkpoint (vision + language) loads its language model
alone; the multi-token-prediction weights some checkpoints carry are left out too."""
from rlcu.models.spec import ArchSpec, register

QWEN3_5 = dict(norm_offset=1.0, qk_norm="head", attn_output_gate=True)

register(ArchSpec("qwen3_5_text", "Qwen3_5ForCausalLM", **QWEN3_5, ignored_prefixes=("mtp.",)))
register(ArchSpec("qwen3_5", "Qwen3_5ForCausalLM", **QWEN3_5, text_config="text_config", export_as="qwen3_5_text",
                  weight_prefixes={"model.language_model.": "model."}, ignored_prefixes=("model.visual.", "mtp.")))
