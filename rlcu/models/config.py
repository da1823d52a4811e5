"""Model configuration of one checkpoint, read from and written to Hugging Face `config.json` so checkpoints
move freely between rlcu and transformers. What its family fixes is its `ArchSpec` (`spec.py`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlcu.models.spec import ArchSpec, family, native_families

ROPE_TYPES_OWN = ("default", "llama3")  # computed here; other types by transformers' own ROPE_INIT_FUNCTIONS
# sanity bounds on a config.json, checked before anything is allocated (a hostile or broken file)
LIMITS = {"vocab_size": 10_000_000, "hidden_size": 1_000_000, "intermediate_size": 10_000_000,
          "num_hidden_layers": 10_000, "num_attention_heads": 10_000, "head_dim": 65_536, "num_experts": 100_000,
          "num_local_experts": 100_000, "moe_intermediate_size": 10_000_000,
          "shared_expert_intermediate_size": 10_000_000}


LINEAR_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
LIMITS.update(dict.fromkeys(LINEAR_SIZES, 65_536))


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # what families beyond Llama choose per checkpoint
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" per layer
    local_rope_theta: float | None = None  # the sliding layers' RoPE, where it differs (Gemma 3)
    local_rope_scaling: dict[str, Any] | None = None
    nope_layers: list[int] = field(default_factory=list)  # layers without RoPE (SmolLM3)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (Phi-4-mini)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attn_logit_softcapping: float | None = None  # scores bounded as cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the LM head's logits bounded so (Gemma 2)
    # mixture of experts (Qwen3-MoE, OLMoE): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones, gated by a sigmoid (Qwen2-MoE)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU: gate * sigmoid(alpha * gate), gate and up clamped
    swiglu_limit: float = 7.0
    # linear-attention layers (Qwen3.5, Qwen3-Next: Gated DeltaNet, `linear_attention.py`) and their sizes
    linear_layers: list[int] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    source: dict[str, Any] | None = field(default=None, repr=False)  # the config.json it was read from

    @property
    def spec(self) -> ArchSpec:
        spec = family(self.model_type)
        if spec is None:
            raise UnsupportedModelError(f"model_type {self.model_type!r} has no native family")
        return spec

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer sees, itself included (HF's `sliding_window`); None: all before it."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window if self.spec.sliding == "all" else None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts; a routing record's layer axis follows this order."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def attention_layers(self) -> list[int]:
        """The layers with keys and values to cache (all but the linear-attention ones)."""
        linear = set(self.linear_layers)
        return [i for i in range(self.num_hidden_layers) if i not in linear]

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a linear-attention layer's convolution: its queries', keys' and values' dims together."""
        keys, values = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads * \
            self.linear_value_head_dim
        return 2 * keys + values

    @property
    def windowed(self) -> bool:
        return any(self.window(i) is not None for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        spec = family(model_type)
        if spec is None:
            raise UnsupportedModelError(f"model_type {model_type!r} has no native family in rlcu (native: "
                                        f"{', '.join(native_families())})")
        text = hf.get(spec.text_config) or {} if spec.text_config else hf
        if spec.text_config and isinstance(text, dict):
            text = dict(text, model_type=spec.export_as or model_type)
        check_sizes(text)
        fields = {**_common_fields(text, spec), **_family_fields(text), **(spec.read(text) if spec.read else {})}
        return cls(**fields, source=dict(text),
                   model_type=spec.export_as or model_type)

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers loads into its own implementation of this model."""
        spec = self.spec
        if self.source is not None:
            out = dict(self.source)
        else:
            own = ("source", "qkv_bias", "o_bias", "qk_norm", "rope_theta", "rope_scaling", "sliding_window",
                   "layer_types", "local_rope_theta", "local_rope_scaling", "nope_layers", "partial_rotary_factor",
                   "attention_scale", "embedding_multiplier", "residual_multiplier", "logits_scaling")
            out = {k: v for k, v in asdict(self).items() if k not in own}
            out["attention_bias"] = self.qkv_bias if self.model_type != "qwen2" else False
            rope = {"rope_type": "default", "rope_theta": self.rope_theta}
            rope.update(self.rope_scaling or {})
            out.update(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, rope_parameters=rope,
                       hidden_act="silu")
            if self.model_type != "llama":
                out["use_sliding_window"] = False
        out.pop("quantization_config", None)  # the weights are written unquantised (gpt-oss: MXFP4 on load)
        out["model_type"] = self.model_type
        out["architectures"] = [spec.architecture]
        return out


def check_sizes(hf: dict[str, Any]) -> None:
    """One line naming the field, before any tensor of that size is allocated."""
    for key, limit in LIMITS.items():
        value = hf.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit):
            raise ValueError(f"config.json: {key}={value!r} is not a size rlcu can build (an integer in 1..{limit}); "
                             "the file is broken or not a model's config")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if not hf.get("head_dim") and heads and hidden and hidden % heads:
        raise ValueError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no "
                         "head_dim is given")


def _rope(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling together here
    if isinstance(rope.get(layer_type), dict):  # one set per layer type (Gemma 3, OLMo 3)
        rope = rope[layer_type]
    elif layer_type in ("sliding_attention", "full_attention") and any(isinstance(v, dict) for v in rope.values()):
        rope = next(v for v in rope.values() if isinstance(v, dict))
    scaling = dict(hf.get("rope_scaling") or {k: v for k, v in rope.items()
                                              if k not in ("rope_theta", "partial_rotary_factor")})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"theta": float(theta), "scaling": dict(scaling, rope_type=rope_type) if rope_type != "default" else None}


def _common_fields(hf: dict[str, Any], spec: ArchSpec) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias") or False)
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{spec.model_type} with clip_qkv={hf['clip_qkv']} has no native path (the "
                                    "released checkpoints set none)")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{spec.model_type} with mlp_bias=true has no native path (no released "
                                    "checkpoint of this family uses it)")
    full = _rope(hf, "full_attention")
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],  # MoE-only models have none
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=full["theta"], rope_scaling=full["scaling"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
        # Seed-OSS names the output projection's bias apart from q/k/v's
        o_bias=bool(hf.get("attention_out_bias", attention_bias)) if spec.o_bias is None else spec.o_bias,
        qk_norm=spec.qk_norm is not None,
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"))


def _linear_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A hybrid's linear-attention layers (named in `layer_types`) and their sizes; nothing for other models."""
    layer_types = hf.get("layer_types") or []
    if "linear_attention" not in layer_types:
        return {}
    out = {key: int(hf[key]) for key in LINEAR_SIZES}
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ValueError(f"config.json: linear_num_value_heads={out['linear_num_value_heads']} is not a multiple "
                         f"of linear_num_key_heads={out['linear_num_key_heads']}")
    return dict(out, linear_layers=[i for i, kind in enumerate(layer_types) if kind == "linear_attention"])


def _softcap_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's soft caps on attention scores and on logits, where the config sets them."""
    out = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = hf.get(key)
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise ValueError(f"config.json: {key}={cap!r} must be a positive number (or null: no capping)")
            out[key] = float(cap)
    return out


def _family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields only some families set; a family that lacks one reads its default."""
    out: dict[str, Any] = {}
    layer_types = hf.get("layer_types")
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") is False or (window is not None and window >= hf.get(
            "max_position_embeddings", 1 << 62)):
        window = None  # off, or wider than any context: the same as full attention
    if window is not None:
        out.update(sliding_window=int(window), layer_types=list(layer_types) if layer_types else None)
    local = _rope(hf, "sliding_attention")
    if local != _rope(hf, "full_attention"):
        out.update(local_rope_theta=local["theta"], local_rope_scaling=local["scaling"])
    if hf.get("rope_local_base_freq") is not None:  # Gemma 3 as transformers 4 wrote it
        out["local_rope_theta"] = float(hf["rope_local_base_freq"])
    if "no_rope_layers" in hf:
        out["nope_layers"] = [i for i, use in enumerate(hf["no_rope_layers"]) if not use]
    rope = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    out["partial_rotary_factor"] = float(factor)
    if hf.get("query_pre_attn_scalar") is not None:
        out["attention_scale"] = float(hf["query_pre_attn_scalar"]) ** -0.5
    if hf.get("attention_multiplier") is not None:
        out["attention_scale"] = float(hf["attention_multiplier"])
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if hf.get(key) is not None:
            out[key] = float(hf[key])
    out.update(_softcap_fields(hf))
    out.update(_linear_fields(hf))
    experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
    if experts:
        top_k = hf.get("num_experts_per_tok") or 0
        if not 0 < top_k <= experts:
            raise ValueError(f"config.json: num_experts_per_tok={top_k!r} must be in 1..{experts} (num_experts)")
        out.update(num_experts=int(experts), num_experts_per_tok=int(top_k),
                   moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
                   mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                   router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
                   shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))
    for key in ("swiglu_alpha", "swiglu_limit"):
        if hf.get(key) is not None:
            out[key] = float(hf[key])
    return out
