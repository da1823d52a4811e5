"""One decoder for every native family (`spec.py`): Llama/SmolLM2, Qwen2/3, Mistral, Granite, OLMo 2/3,
Phi-3, SmolLM3, Gemma 3, with Hugging Face parameter names, so that state dicts load from and save to HF
folders unchanged. What differs between families (norm placement and `1 + w`, activation, q/k norms, RoPE
per layer, partial RoPE and NoPE layers, sliding windows, multipliers) comes from the config's spec.

Attention is delegated to an `AttentionContext`, which is how training, the reference rollout and the
paged engine all run these same modules and parameters. The q/k/v and gate/up projections are each
one GEMM (`FusedLinear`); HF folders name their parts, and loading.py converts at the boundary."""
from __future__ import annotations

import math

import torch
from torch import nn

from rlcu.contracts import Numerics
from rlcu.kernels._recompute import recompute_contexts
from rlcu.kernels._triton import next_pow2
from rlcu.kernels.kv_cache import FP8
from rlcu.kernels.rmsnorm import rms_norm
from rlcu.kernels.silu_mul import gated_mul
from rlcu.models.attention import AttentionContext, DenseKVCache, PackedAttention, PaddedAttention, fuses_qk_norm
from rlcu.models.config import ModelConfig
from rlcu.models.exact_attention import ExactPackedAttention
from rlcu.models.fused_linear import FusedLinear, Linear
from rlcu.models.linear_attention import GatedDeltaNet
from rlcu.models.moe import SparseMoE
from rlcu.models.tensor_parallel import copy_in, embed_share, split_rms_norm


class RMSNorm(nn.Module):
    """With `residual`, adds it first and returns (normed, x + residual): the fused form the engine uses.
    `offset` 1.0: the weight is stored as w and scales by 1 + w, in fp32 before rounding (Gemma).
    `tensor_parallel`: set on a q/k norm under tensor parallelism (`tensor_parallel.py`). Per head, each rank
    normalises its own heads with the whole weight, whose gradient is then the sum of the ranks'; over all heads
    (`split_dim`, the whole width: OLMo), each rank holds its heads' columns of x and of the weight, and the
    squares are summed over the ranks. `x_scale`: with a residual, x is scaled by it before the add, in the
    kernel's launch (Granite's residual multiplier: residual + branch * multiplier). `add_to`: returns
    add_to + norm(x), the add in the norm's launch (OLMo's post-norm residual; the layer norms that take it are
    never split)."""

    tensor_parallel = None
    split_dim: int | None = None
    x_scale = 1.0

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, add_to: torch.Tensor | None = None):
        if self.split_dim:
            return split_rms_norm(x, self.weight, self.eps, self.split_dim, self.tensor_parallel)
        return rms_norm(x, self.operand(), self.eps, residual, self.offset, x_scale=self.x_scale, add_to=add_to)

    def operand(self) -> torch.Tensor:
        """The weight as the forward multiplies by it: under tensor parallelism through `copy_in`, so that its
        gradient is summed over the ranks (also where a kernel applies the norm: `qk_norm_operands`)."""
        return self.weight if self.tensor_parallel is None else copy_in(self.weight, self.tensor_parallel)


def rope_inv_freq(cfg: ModelConfig, local: bool, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], cos/sin scale) of the full layers' RoPE, or the sliding layers'."""
    theta, scaling = (cfg.local_rope_theta, cfg.local_rope_scaling) if local else (cfg.rope_theta, cfg.rope_scaling)
    if scaling and scaling.get("rope_type") != "llama3":
        return hf_rope_inv_freq(cfg, local, device)
    d = cfg.rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if scaling:
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq, 1.0


def hf_rope_inv_freq(cfg: ModelConfig, local: bool, device) -> tuple[torch.Tensor, float]:
    """Other RoPE types (linear, dynamic, yarn, longrope) by transformers' own definitions, at their initial
    frequencies: an engine batch has no one sequence length to re-scale by."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.source is None:
        raise ValueError("a RoPE scaling other than llama3 needs the checkpoint's config.json (ModelConfig.source)")
    hf = AutoConfig.for_model(**cfg.source)
    nested = isinstance((cfg.source.get("rope_parameters") or {}).get("full_attention"), dict)
    scaling = cfg.local_rope_scaling if local else cfg.rope_scaling
    layer_type = ("sliding_attention" if local else "full_attention") if nested else None
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, device, layer_type=layer_type)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        spec = cfg.spec
        self.layer_idx, self.window, self.scale = layer_idx, cfg.window(layer_idx), cfg.scale
        self.softcap = cfg.attn_logit_softcapping
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        h, d = cfg.hidden_size, cfg.head_dim
        kv = self.num_kv_heads * d
        self.output_gate = spec.attn_output_gate
        q_rows = self.num_heads * d * (2 if self.output_gate else 1)
        self.qkv_proj = FusedLinear(h, {"q_proj": q_rows, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = FusedLinear(self.num_heads * d, {"o_proj": h}, cfg.o_bias)
        self.register_parameter("sinks", nn.Parameter(torch.zeros(self.num_heads)) if spec.attention_sinks else None)
        self.qk_norm = (spec.qk_norm or "head") if cfg.qk_norm else None
        if self.qk_norm:
            q_dim, k_dim = (d, d) if self.qk_norm == "head" else (self.num_heads * d, kv)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, spec.norm_offset)

    def forward(self, x, cos, sin, attention: AttentionContext):
        b, t, _ = x.shape
        exact = attention.batch_invariant
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, exact))
        gate = None
        if self.output_gate:  # each head's rows: its query, then its gate
            q, gate = q.unflatten(-1, (self.num_heads, 2 * self.head_dim)).split(self.head_dim, dim=-1)
            q, gate = q.flatten(-2), gate.flatten(-2)
        if self.qk_norm == "full":  # OLMo 2: over the whole projection, before heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k, v = k.unflatten(-1, (self.num_kv_heads, self.head_dim)), v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        norms = {} if self.sinks is None else {"sinks": self.sinks}
        if self.softcap is not None:
            norms["softcap"] = self.softcap
        if self.qk_norm == "head":  # Qwen3, Gemma 3: handed to a context that fuses them, else applied here
            # (the fused kernel normalises whole heads that it rotates whole: not under partial RoPE)
            if getattr(attention, "applies_qk_norm", False) and self.rotary_dim == self.head_dim:
                norms["qk_norm"] = (self.q_norm, self.k_norm)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        # under partial RoPE (Phi-3, Qwen3.5) the tables are rotary_dim wide, and the context rotates that many dims
        out = attention(self.layer_idx, q, k, v, cos, sin, scale=self.scale, window=self.window, **norms)
        out = out.reshape(b, t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out, exact)


def identity_rope(like: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0: tables under which every context's RoPE leaves q and k as they are (NoPE layers)."""
    shape = (*like.shape[:-1], head_dim)
    return like.new_ones(shape), like.new_zeros(shape)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate_proj": i, "up_proj": i}, False)
        self.down_proj = FusedLinear(i, {"down_proj": cfg.hidden_size}, False)
        self.activation = cfg.spec.activation

    def forward(self, x, batch_invariant: bool = False, record=None):
        """`record`: SparseMoE's routing recorder, which a dense MLP has nothing to give."""
        return self.down_proj(gated_mul(self.gate_up_proj(x, batch_invariant), self.activation), batch_invariant)


class DecoderLayer(nn.Module):
    """`forward` returns (branch output, residual stream): the next layer's first norm adds the two (fused). A
    post-norm layer (OLMo) adds its branches inside its norms' launches and returns (residual stream, None)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        spec = cfg.spec
        self.norm = spec.norm
        self.rope_kind = None if layer_idx in cfg.nope_layers else (
            "local" if cfg.local_rope_theta is not None and cfg.window(layer_idx) is not None else "full")
        self.linear = layer_idx in cfg.linear_layers
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        shared = cfg.shared_expert_intermediate_size
        moe = cfg.is_moe_layer(layer_idx)
        self.mlp = (SparseMoE(cfg, MLP(cfg, shared) if shared else None, cfg.moe_layers.index(layer_idx)) if moe
                    else MLP(cfg))
        self.moe = moe
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset)
        if spec.norm != "post":
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if spec.norm == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if spec.norm != "pre":
            self.post_feedforward_layernorm = norm()
        if spec.norm == "pre":  # Granite: residual + branch * multiplier, the multiply in the next norm's add
            self.input_layernorm.x_scale = self.post_attention_layernorm.x_scale = cfg.residual_multiplier

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: attention, or Gated DeltaNet in a hybrid's linear-attention layers."""
        return self.linear_attn if self.linear else self.self_attn

    def forward(self, x, cos, sin, attention, residual=None):
        exact = attention.batch_invariant
        # an MoE layer hands its routing to a context that records it (the engine's, AttentionContext)
        record = getattr(attention, "record_routing", None) if self.moe else None
        if self.norm == "post":  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x)), each add in its norm's launch
            x = self.post_attention_layernorm(self.mixer(x, cos, sin, attention), add_to=x)
            return self.post_feedforward_layernorm(self.mlp(x, exact, record), add_to=x), None
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.mixer(h, cos, sin, attention)
        if self.norm == "sandwich":  # Gemma: norms after each branch too
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h, exact, record)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, exact, record), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.spec.norm_offset)
        if cfg.spec.norm == "pre":  # the last layer's branch, scaled as DecoderLayer's are
            self.norm.x_scale = cfg.residual_multiplier


class CausalLM(nn.Module):
    """`forward` returns final hidden states; `lm_head` maps them to logits. Keeping the two apart
    lets training compute token log-probabilities in chunks instead of materialising [T, vocab].
    Declared capabilities: `native` (the paged engine runs it), `logits_from_forward` False (logprobs
    come from hidden states times `lm_head`, in chunks)."""

    native = True
    logits_from_forward = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.softcap = cfg.final_logit_softcapping
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq: dict[tuple[str, torch.device], tuple[torch.Tensor, float]] = {}
        # fixed by the spec: decided once here, not on every forward (the engine's eager steps run it)
        kinds = [layer.rope_kind for layer in self.model.layers]
        self.rope_kinds = sorted({k for k in kinds if k})
        self.has_nope = None in kinds
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.spec.embed_scale == "sqrt_hidden" else None
        self.gradient_checkpointing = False

    def check_numerics(self, numerics: Numerics) -> None:
        """Whether this model can compute in `numerics`. EXACT runs every computation whose rounding could depend
        on the batch through batch-invariant kernels (GEMMs with fixed tiles; attention through the engine's
        paged kernel, `exact_attention.py`), when the forward's context asks for it (docs/engine.md)."""
        if not numerics.batch_invariant:
            return
        d = self.config.head_dim
        if not d == next_pow2(d) >= 16:  # the paged attention kernel's tl.dot tiles
            raise ValueError(f"exact_logprobs needs a power-of-two head_dim >= 16 (the paged attention kernel), got "
                             f"{d}: set exact_logprobs: false")
        if any(isinstance(m, FusedLinear) and m.lora is not None and not isinstance(m.lora.dropout, nn.Identity)
               for m in self.modules()):
            raise ValueError("exact_logprobs with lora_dropout > 0: training would drop what the sampler kept; set "
                             "lora_dropout: 0")

    def cast_lm_head_to_fp32(self) -> None:
        """TRL's `cast_lm_head_to_fp32` (ScaleRL's recipe): the head's weight in float32 and its logits computed in
        float32 outside autocast, in the engine and in training alike (`Linear.fp32`)."""
        if self.config.tie_word_embeddings and self.dtype != torch.float32:
            raise ValueError(f"cast_lm_head_to_fp32 with the LM head tied to the embeddings, loaded in {self.dtype}: "
                             "the embeddings would turn float32 too; load with model.dtype float32 (the mixed "
                             "precision then computes the rest in bf16), or set cast_lm_head_to_fp32 false")
        self.lm_head.float()
        self.lm_head.fp32 = True

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

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype, kind: str = "full"):
        """cos, sin [B, T, 1, rotary_dim] of the full layers' RoPE ("full") or the sliding layers' ("local")."""
        dev = position_ids.device
        if (kind, dev) not in self._inv_freq:
            self._inv_freq[kind, dev] = rope_inv_freq(self.config, kind == "local", dev)
        inv_freq, scale = self._inv_freq[kind, dev]
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]: broadcast over heads
        if scale != 1.0:
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.model.embed_tokens
        tp = getattr(table, "tensor_parallel", None)  # the table split by rows of the vocabulary
        x = table(input_ids) if tp is None else embed_share(input_ids, table.weight, tp)
        if self.embed_scale is not None:  # rounded to the weights' dtype first, as Gemma does
            return x * torch.tensor(self.embed_scale, dtype=x.dtype)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention: AttentionContext | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        attention = attention or PaddedAttention(None)
        x = self.embed(input_ids)
        tables = {kind: self.rope(position_ids, x.dtype, kind) for kind in self.rope_kinds}
        if self.has_nope:
            tables[None] = identity_rope(next(iter(tables.values()))[0] if tables else
                                         x.new_empty(*position_ids.shape, 1, 1), self.config.head_dim)
        residual = None
        for layer in self.model.layers:
            cos, sin = tables[layer.rope_kind]
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, residual = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, attention, residual, use_reentrant=False,
                    context_fn=torch.utils.checkpoint.noop_context_fn if layer.moe else recompute_contexts)
            else:
                x, residual = layer(x, cos, sin, attention, residual)
        out = self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]
        s = self.config.logits_scaling  # Granite's logits / s, folded into the hidden states the LM head reads
        return out if s == 1.0 else out / s

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Hidden states of a padded batch; positions count only the real tokens of each row (None: no
        padding anywhere, so plain causal attention)."""
        if attention_mask is None:
            return self(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return self(input_ids, position_ids, PaddedAttention(attention_mask))  # __call__: FSDP's hooks run

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_len: int, numerics: Numerics = Numerics.FAST) -> torch.Tensor:
        """Hidden states [1, T, H] of several sequences packed into one row (no padding); positions restart
        at 0 at each `cu_seqlens` boundary. EXACT: through the engine's own attention kernel and GEMMs (EXACT_FP8:
        its keys and values rounded to e4m3 in between, as the engine's FP8 cache holds them)."""
        if numerics.batch_invariant:
            kv = FP8 if numerics.kv_cache_dtype == "fp8" else self.compute_dtype()
            fused = fuses_qk_norm(self.config, cu_seqlens)
            return self(input_ids, position_ids, ExactPackedAttention(cu_seqlens, max_len, kv, fused))
        return self(input_ids, position_ids, PackedAttention(cu_seqlens, max_len))

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            return self.lm_head(self(input_ids))
        return self.lm_head(self.forward_padded(input_ids, attention_mask))

    def incremental(self, batch: int, max_len: int) -> "DenseIncremental":
        """Lockstep decoding of a left-padded batch over a dense KV cache (the reference backend)."""
        return DenseIncremental(self, batch, max_len)


class DenseIncremental:
    def __init__(self, model: CausalLM, batch: int, max_len: int):
        cfg = model.config
        self.model = model
        self.cache = DenseKVCache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                  model.dtype, model.device)

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model(ids, pos, self.cache.step(valid))[:, -1])

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        step = self.cache.step(torch.ones(len(tok), 1, dtype=torch.bool, device=tok.device))
        return self.model.lm_head(self.model(tok[:, None], pos, step)[:, -1])
