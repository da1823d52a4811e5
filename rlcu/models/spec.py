"""What varies between decoder families, as data. One decoder (`decoder.py`) is built from an `ArchSpec`
and a `ModelConfig`; a family is a spec registered here, its weight-name map, and a parity test against
transformers' own module (tests/models/test_families.py).

The spec holds what a family fixes (where its norms sit, its activation, its q/k norms, how its
checkpoints name and nest weights); the `ModelConfig` holds what one checkpoint chooses (sizes, RoPE,
sliding windows, multipliers)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

NormPlacement = Literal["pre", "sandwich", "post"]


@dataclass(frozen=True)
class ArchSpec:
    """`norm`: "pre" (Llama: a norm before attention and before the MLP), "sandwich" (Gemma 2/3: those two plus
    a norm after each), "post" (OLMo 2/3: a norm after attention and after the MLP only).
    `norm_offset`: 1.0 where the checkpoint stores `w` and the norm scales by `1 + w` (Gemma).
    `qk_norm`: None, "head" (one RMSNorm over each head: Qwen3, Gemma 3) or "full" (one over the whole
    projection before heads are split: OLMo 2). `qkv_bias`/`o_bias`: None reads the config's `attention_bias`.
    `embed_scale`: "sqrt_hidden" (Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype)
    or None (the config's `embedding_multiplier`, 1 by default: Granite).
    `attn_output_gate`: q_proj also projects a gate per head (Qwen3.5, Qwen3-Next), the second half of each head's
    rows; attention's output is multiplied by its sigmoid before o_proj.
    `attention_sinks`: a learned logit per query head in each attention's softmax (gpt-oss, `rlcu/kernels/sdpa.py`).
    `moe_bias`: the router and the experts' projections carry biases (gpt-oss). `expert_activation`: the experts'
    gated activation where it differs from the dense MLPs' ("clamped_swiglu": gpt-oss's, with the config's
    `swiglu_alpha` and `swiglu_limit`). `experts_interleaved`: the checkpoint interleaves the gate and up columns of
    its experts' gate_up_proj (gpt-oss); rlcu keeps the gate half first, and LoRA's export follows the checkpoint.
    `sliding`: "layer_types" (sliding layers are named in the config's `layer_types`) or "all" (every layer
    uses `sliding_window` when it is set: Mistral, Phi-3).
    `hf_fused`: projections the checkpoint stores fused already (Phi-3's `qkv_proj`, `gate_up_proj`; "experts":
    the experts stacked, Granite-MoE's), which export keeps fused. `weight_prefixes`: checkpoint prefix -> rlcu
    prefix (the language model of a composite checkpoint); `ignored_prefixes`: weights of the checkpoint that the
    language model does not use (a vision tower), left out with a log line. `text_config`: the language model's
    config is nested under this key of config.json. `read`: the family's own config.json fields -> ModelConfig fields.
    `load_weights`/`save_weights`: the family's own tensor layout <-> rlcu's, at the folder's boundary (Qwen3-Next
    interleaves its linear-attention projections per key head), given the state dict and the ModelConfig."""

    model_type: str
    architecture: str
    norm: NormPlacement = "pre"
    norm_offset: float = 0.0
    activation: Literal["silu", "gelu_tanh"] = "silu"
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: Literal["head", "full"] | None = None
    embed_scale: Literal["sqrt_hidden"] | None = None
    attn_output_gate: bool = False
    attention_sinks: bool = False
    moe_bias: bool = False
    expert_activation: Literal["clamped_swiglu"] | None = None
    experts_interleaved: bool = False
    sliding: Literal["layer_types", "all"] = "layer_types"
    hf_fused: tuple[str, ...] = ()
    weight_prefixes: dict[str, str] = field(default_factory=dict)
    ignored_prefixes: tuple[str, ...] = ()
    text_config: str | None = None
    export_as: str | None = None
    read: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    load_weights: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    save_weights: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None


FAMILIES: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Make a family loadable by its config.json `model_type`; a plugin calls this at import."""
    FAMILIES[spec.model_type] = spec
    return spec


def family(model_type: str) -> ArchSpec | None:
    import rlcu.models.families  # noqa: F401  (registers the built-in families)

    return FAMILIES.get(model_type)


def native_families() -> list[str]:
    import rlcu.models.families  # noqa: F401

    return sorted(FAMILIES)
