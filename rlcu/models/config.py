"""Model configuration for the Llama family (Llama/SmolLM2, Qwen2/2.5, Qwen3), read from and
written to Hugging Face `config.json` so checkpoints move freely between rlcu and transformers."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# model_type -> (transformers architecture name, q/k/v bias, o bias, per-head q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[str, bool | None, bool | None, bool]] = {
    "llama": ("LlamaForCausalLM", None, None, False),  # None: taken from config.attention_bias
    "qwen2": ("Qwen2ForCausalLM", True, False, False),
    "qwen3": ("Qwen3ForCausalLM", None, None, True),
}


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
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; rlcu runs {sorted(ARCHITECTURES)} "
                "(Llama/SmolLM2, Qwen2/2.5, Qwen3)")
        _, qkv_bias, o_bias, qk_norm = ARCHITECTURES[model_type]
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(f"{model_type} with use_sliding_window=true is not supported")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported (no released Llama-family model uses it)")
        attention_bias = bool(hf.get("attention_bias") or False)
        rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling together here
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: default, llama3)")
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(scaling, rope_type=rope_type) if rope_type != "default" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            qk_norm=qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers loads into its own implementation of this model."""
        out = {k: v for k, v in asdict(self).items() if k not in ("extra", "qkv_bias", "o_bias", "qk_norm",
                                                                   "rope_theta", "rope_scaling")}
        out["architectures"] = [ARCHITECTURES[self.model_type][0]]
        out["attention_bias"] = self.qkv_bias if self.model_type != "qwen2" else False
        out["rope_theta"] = self.rope_theta
        out["rope_scaling"] = self.rope_scaling
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(self.rope_scaling or {})
        out["rope_parameters"] = rope
        out["hidden_act"] = "silu"
        if self.model_type != "llama":
            out["use_sliding_window"] = False
        return out
