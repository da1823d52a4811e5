"""Granite 3: Llama's layers with four multipliers (embeddings, residual branches, attention scale, logits).
Granite-MoE: the same layers with mixture-of-experts MLPs (`rlcu/models/moe.py`): softmax over the top-k router
logits (the probabilities renormalised over the chosen experts), each checkpoint layer's experts in two stacked
tensors (`block_sparse_moe.input_linear` [E, 2I, H], gate rows first, and `output_linear` [E, H, I]) and its
router in `block_sparse_moe.router.layer`."""
from rlcu.models.spec import ArchSpec, register

register(ArchSpec("granite", "GraniteForCausalLM"))

# the checkpoint's names within a layer -> rlcu's
GRANITEMOE_NAMES = {"block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
                    "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
                    "block_sparse_moe.router.layer.weight": "mlp.gate.weight"}


def _rename(state: dict, names: dict[str, str]) -> dict:
    out = {}
    for key, value in state.items():
        for theirs, ours in names.items():
            if key.endswith("." + theirs):
                key = key[:-len(theirs)] + ours
                break
        out[key] = value
    return out


register(ArchSpec("granitemoe", "GraniteMoeForCausalLM", hf_fused=("experts",),
                  read=lambda hf: {"norm_topk_prob": True},
                  load_weights=lambda state, cfg: _rename(state, GRANITEMOE_NAMES),
                  save_weights=lambda state, cfg: _rename(state, {v: k for k, v in GRANITEMOE_NAMES.items()})))
