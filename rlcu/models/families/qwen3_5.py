"""Qwen3.5 and Qwen3-Next: three Gated DeltaNet layers (linear attention, `rlcu/models/linear_attention.py`) to one
full-attention layer, whose q_proj also projects an output gate and whose RoPE covers a quarter of each head;
`1 + w` RMSNorms (the gated norm inside DeltaNet scales by w). The MoE variants (Qwen3.5-MoE, Qwen3-Next) add a
shared expert beside the routed ones (`rlcu/models/moe.py`); Qwen3.5-MoE always renormalises its top-k weights.
Qwen3-Next's checkpoints interleave the linear-attention projections per key head, which loading undoes.
A vision + language checkpoint loads its language model alone; the multi-token-prediction weights some
checkpoints carry are left out too."""
from rlcu.models.linear_attention import group_projections, ungroup_projections
from rlcu.models.spec import ArchSpec, register

QWEN3_5 = dict(norm_offset=1.0, qk_norm="head", attn_output_gate=True)
COMPOSITE = dict(text_config="text_config", weight_prefixes={"model.language_model.": "model."},
                 ignored_prefixes=("model.visual.", "mtp."))


def renormalised(hf):
    return {"norm_topk_prob": True}


register(ArchSpec("qwen3_5_text", "Qwen3_5ForCausalLM", **QWEN3_5, ignored_prefixes=("mtp.",)))
register(ArchSpec("qwen3_5", "Qwen3_5ForCausalLM", **QWEN3_5, **COMPOSITE, export_as="qwen3_5_text"))
register(ArchSpec("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", **QWEN3_5, ignored_prefixes=("mtp.",),
                  read=renormalised))
register(ArchSpec("qwen3_5_moe", "Qwen3_5MoeForCausalLM", **QWEN3_5, **COMPOSITE, export_as="qwen3_5_moe_text",
                  read=renormalised))
register(ArchSpec("qwen3_next", "Qwen3NextForCausalLM", **QWEN3_5, ignored_prefixes=("mtp.",),
                  load_weights=ungroup_projections, save_weights=group_projections))
