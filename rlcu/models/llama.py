"""The Llama family (Llama/SmolLM2, Qwen2/2.5 with q/k/v bias, Qwen3 with per-head q/k RMSNorm) with
Hugging Face parameter names, so that state dicts load from and save to HF folders unchanged.

Attention is delegated to an `AttentionContext`, which is how training, the reference rollout and the
paged engine all run these same modules and parameters. The q/k/v and gate/up projections are each
one GEMM (`FusedLinear`); HF folders name their parts, and loading.py converts at the boundary."""
from __future__ import annotations

import math

import torch
from torch import nn

from rlcu.kernels._triton import next_pow2
from rlcu.kernels.rmsnorm import rms_norm
from rlcu.kernels.silu_mul import silu_mul
from rlcu.models.attention import AttentionContext, PackedAttention, PaddedAttention
from rlcu.models.config import ModelConfig
from rlcu.models.exact_attention import ExactPackedAttention
from rlcu.models.fused_linear import FusedLinear, Linear


class RMSNorm(nn.Module):
    """With `residual`, adds it first and returns (normed, x + residual): the fused form the engine uses."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = cfg.rope_scaling
    if s and s.get("rope_type") == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        kv = self.num_kv_heads * d
        self.qkv_proj = FusedLinear(h, {"q_proj": self.num_heads * d, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = FusedLinear(self.num_heads * d, {"o_proj": h}, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionContext):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k, v = k.unflatten(-1, (self.num_kv_heads, self.head_dim)), v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        norms = {}
        if hasattr(self, "q_norm"):  # Qwen3: handed to a context that fuses them, else applied here
            if getattr(attention, "applies_qk_norm", False):
                norms = {"qk_norm": (self.q_norm, self.k_norm)}
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        out = attention(self.layer_idx, q, k, v, cos, sin, **norms)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate_proj": i, "up_proj": i}, False)
        self.down_proj = FusedLinear(i, {"down_proj": cfg.hidden_size}, False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention, residual=None):
        """Returns (mlp output, residual stream); the next layer's first norm adds the two (fused)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, attention)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` returns final hidden states; `lm_head` maps them to logits. Keeping the two apart
    lets training compute token log-probabilities in chunks instead of materialising [T, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.gradient_checkpointing = False
        self.exact_logprobs = False  # set_exact_logprobs

    def set_exact_logprobs(self, on: bool = True) -> None:
        """Make every computation whose rounding could depend on the batch run batch-invariant kernels
        (GEMMs with fixed tiles; attention through the engine's paged kernel, `exact_attention.py`), so
        that the engine's logprobs equal the training forward's to the bit (docs/engine.md)."""
        d = self.config.head_dim
        if on and not d == next_pow2(d) >= 16:  # the paged attention kernel's tl.dot tiles
            raise ValueError(f"exact_logprobs needs a power-of-two head_dim >= 16 (the paged attention kernel), got "
                             f"{d}: set exact_logprobs: false")
        if on and any(isinstance(m, FusedLinear) and m.lora is not None for m in self.modules()):
            raise ValueError("exact_logprobs does not cover LoRA adapters (the engine adds them with other GEMMs "
                             "than training does): merge the adapters or set exact_logprobs: false")
        for m in self.modules():
            if isinstance(m, Linear):
                m.batch_invariant = on
        self.exact_logprobs = on

    def compute_dtype(self) -> torch.dtype:
        """What attention's inputs and the KV cache are in: the autocast dtype under mixed precision, else the
        parameters' dtype."""
        kind = self.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (the compute dtype unless autocast is on)."""
        return self.model.embed_tokens.weight.dtype

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        dev = position_ids.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = rope_inv_freq(self.config, dev)
        freqs = position_ids[..., None].float() * self._inv_freq[dev]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]: broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention: AttentionContext | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        attention = attention or PaddedAttention(None)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        residual = None
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, residual = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attention, residual,
                                                                use_reentrant=False)
            else:
                x, residual = layer(x, cos, sin, attention, residual)
        return self.model.norm(x, residual)[0]

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Hidden states of a padded batch; positions count only the real tokens of each row (None: no
        padding anywhere, so plain causal attention)."""
        if attention_mask is None:
            return self(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return self(input_ids, position_ids, PaddedAttention(attention_mask))  # __call__: FSDP's hooks run

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_len: int) -> torch.Tensor:
        """Hidden states [1, T, H] of several sequences packed into one row (no padding); positions restart
        at 0 at each `cu_seqlens` boundary."""
        if self.exact_logprobs:
            return self(input_ids, position_ids, ExactPackedAttention(cu_seqlens, max_len, self.compute_dtype()))
        return self(input_ids, position_ids, PackedAttention(cu_seqlens, max_len))

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            return self.lm_head(self(input_ids))
        return self.lm_head(self.forward_padded(input_ids, attention_mask))
