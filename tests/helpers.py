"""Tiny random models of each family, saved as HF folders by transformers itself, plus a word-level
tokenizer, so tests compare rlcu with the real reference implementation without any download."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "llama-untied-bias": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=True)),
}


def word_tokenizer(vocab_size: int, path: Path | None = None):
    """Tokens t0..t{V-3}, <pad>, <eos>; whitespace-split, so text and ids map one to one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<pad>"], vocab["<eos>"] = vocab_size - 2, vocab_size - 1
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    if path is not None:
        tok.save_pretrained(path)
    return tok


def tiny_hf_folder(path: Path, family: str = "llama", vocab_size: int = 64, hidden: int = 48, layers: int = 2,
                   heads: int = 6, kv_heads: int = 2, head_dim: int | None = 16, seed: int = 0, **overrides) -> Path:
    """A transformers model with random weights (GQA group 3 by default), saved as an HF folder."""
    import transformers

    spec = FAMILIES[family]
    cfg_cls = getattr(transformers, spec["cls"])
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
              rms_norm_eps=1e-6, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 2, bos_token_id=None)
    kw.update(spec["extra"])
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    word_tokenizer(vocab_size, path)
    return Path(path)
