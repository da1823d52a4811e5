"""The transformers fallback: any causal LM that transformers runs and rlcu has no native family for trains
on its own HF modules and parameters. Training takes its logits from the HF forward (so whatever the
family does after the last layer, soft-capping or scaling, holds); rollouts come from the reference
backend, which drives the same module (`incremental`): with rlcu's attention over a static cache where the
model allows (`hf_decode.py`), else with transformers' KV cache. Slower than the native path (no paged
engine, no fused kernels), and said so in a log line; docs list the native families."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from rlcu.models.loading import joined_stops

log = logging.getLogger(__name__)


@functools.cache
def _cache_name() -> str:
    """The KV cache's keyword and output field: `cache` from transformers 5.24 (`past_key_values` before)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class HFConfigView:
    """What rlcu reads of a model's config, from a transformers config."""

    def __init__(self, hf_config, generation_config=None):
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.hf = hf_config
        self.model_type = hf_config.model_type
        self.vocab_size = text.vocab_size
        self.max_position_embeddings = getattr(text, "max_position_embeddings", None) or 1 << 20
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        self.num_hidden_layers = getattr(text, "num_hidden_layers", None)
        self.bos_token_id, self.pad_token_id = text.bos_token_id, text.pad_token_id
        self.eos_token_id = text.eos_token_id
        # the ids generation_config.json adds (gpt-oss's <|call|>, Llama 3's <|eot_id|>), as transformers' generate
        # stops at them
        self.eos_token_id = joined_stops(text.eos_token_id, getattr(generation_config, "eos_token_id", None))

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class HFCausalLM(nn.Module):
    """A transformers `...ForCausalLM` behind the interface rlcu's training and reference rollout use.
    Declared capabilities: `native` False (no paged engine), `logits_from_forward` True (completion
    logprobs come from `logits`, not from hidden states times `lm_head`)."""

    native = False
    logits_from_forward = True
    static_decoding = True  # False once the model's attention asked for what rlcu's static cache lacks

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model.train()
        self.config = HFConfigView(hf_model.config, getattr(hf_model, "generation_config", None))
        for m in hf_model.modules():  # as rlcu's own models (and TRL's disable_dropout): the sampler's logprobs
            if isinstance(m, nn.Dropout):  # must be the trainer's
                m.p = 0.0

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def compute_dtype(self) -> torch.dtype:
        kind = self.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.dtype

    @property
    def gradient_checkpointing(self) -> bool:
        name = "is_activation_checkpointing" if hasattr(type(self.hf), "is_activation_checkpointing") else \
            "is_gradient_checkpointing"  # renamed in transformers 5.24
        return bool(getattr(self.hf, name, False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        # transformers 5.24 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
        new = hasattr(self.hf, "activation_checkpointing_enable")
        if on:
            kwargs = {"use_reentrant": False}
            if new:
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif self.gradient_checkpointing:
            (self.hf.activation_checkpointing_disable if new else self.hf.gradient_checkpointing_disable)()

    def check_numerics(self, numerics) -> None:
        if numerics.batch_invariant:
            raise ValueError(f"exact_logprobs needs a native family (the engine's kernels); {self.config.model_type} "
                             "runs on the transformers fallback: set exact_logprobs: false")

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               keep: int = 0) -> torch.Tensor:
        """[B, T, vocab] (the last `keep` positions only, when keep > 0); positions count real tokens only."""
        position_ids = None
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False, logits_to_keep=keep)
        return out.logits

    def incremental(self, batch: int, max_len: int):
        """The reference backend's decoder: rlcu's static cache inside the HF modules (`hf_decode`, CUDA
        graphs on CUDA) where the model declares attention through transformers' interface, else
        transformers' own cache."""
        from rlcu.models import hf_decode

        if self.static_decoding and hf_decode.supported(self.hf):
            return hf_decode.StaticDecoder(self, batch, max_len, slow=lambda: HFIncremental(self))
        return HFIncremental(self)


class HFIncremental:
    """Decoding a left-padded batch in lockstep over transformers' own KV cache (the reference backend's
    `model.incremental(...)`): `prefill` the prompts, then `step` one token per row."""

    def __init__(self, model: HFCausalLM):
        self.model, self.cache, self.mask = model, None, None

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = valid.long()
        out = self.model.hf(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True,
                            logits_to_keep=1)
        self.cache = getattr(out, _cache_name())
        return out.logits[:, -1]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tok), 1)], 1)
        out = self.model.hf(input_ids=tok[:, None], attention_mask=self.mask, position_ids=pos, use_cache=True,
                            **{_cache_name(): self.cache})
        self.cache = getattr(out, _cache_name())
        return out.logits[:, -1]


def load_hf_model(folder: Path, dtype, trust_remote_code: bool = False):
    """(HFCausalLM, tokenizer) of a folder whose model_type has no native family."""
    import transformers

    from rlcu.models.loading import load_tokenizer, resolve_dtype
    from rlcu.models.spec import native_families

    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype), config=config,
                                                                  trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ValueError(f"{folder}: the model's code lives in its repository, and rlcu runs it only with "
                             "trust_remote_code=True (TRL's name; --model.trust_remote_code=true)") from None
        native = ", ".join(native_families())
        raise ValueError(f"{folder}: transformers {transformers.__version__} cannot load this model either "
                         f"({str(e).splitlines()[0]}); rlcu's native families: {native}") from None
    log.warning("%s: model_type %r has no native family in rlcu; it runs on the transformers fallback (its HF "
                "modules for training and rollouts, without the paged engine: slower). "
                "Native: %s", folder.name, config.model_type, ", ".join(native_families()))
    return HFCausalLM(model), load_tokenizer(folder)
