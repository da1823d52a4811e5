"""Tiny random models of each family, saved as HF folders by transformers itself, plus a word-level
tokenizer, so tests compare rlcu with the real reference implementation without any download."""
from __future__ import annotations

from pathlib import Path

import torch

from rlcu.bench import word_tokenizer

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "llama-untied-bias": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=True)),
}


def tiny_hf_folder(path: Path, family: str = "llama", vocab_size: int = 64, hidden: int = 48, layers: int = 2,
                   heads: int = 6, kv_heads: int = 2, head_dim: int | None = 16, seed: int = 0,
                   chat_template: str | None = None, **overrides) -> Path:
    """A transformers model with random weights (GQA group 3 by default), saved as an HF folder."""
    import transformers

    spec = FAMILIES[family]
    cfg_cls = getattr(transformers, spec["cls"])
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024,
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
    tok = word_tokenizer(vocab_size)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    return Path(path)


def reference_generate(model, prompts, sampling, tokenizer=None):
    """The oracle: the reference rollout backend on `model`."""
    from types import SimpleNamespace

    from rlcu.rollout.reference import ReferenceRollout

    backend = ReferenceRollout()
    backend.setup(SimpleNamespace(policy=model, tokenizer=tokenizer))
    return backend.generate(prompts, sampling)


def toy_rows(n: int, seed: int = 0, chat: bool = False) -> list[dict]:
    """Prompt 'tD' (D in 0..7); the verifiable answer is token t(D+8), repeated."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randrange(8)
        prompt = [{"role": "user", "content": f"t{d}"}] if chat else f"t{d}"
        rows.append({"prompt": prompt, "target": d + 8})
    return rows


def match_target(prompts, completions, completion_ids, target, **kwargs):
    """A TRL-style reward: the fraction of 4 completion tokens equal to the row's target token."""
    return [sum(t == tg for t in ids) / 4 for ids, tg in zip(completion_ids, target)]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def fit(module, rows, steps: int, log_dir, batch_size: int = 4, max_epochs: int | None = None,
        accelerator: str = "cpu", precision: str = "32-true"):
    """Train with Lightning on CPU and return the logged metrics rows (CSV logger, as users see them)."""
    import csv
    import logging

    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from rlcu.data.prompts import collate_rows

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    trainer = L.Trainer(max_steps=steps, max_epochs=max_epochs, accelerator=accelerator, devices=1, precision=precision, logger=L.loggers.CSVLogger(log_dir), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, DataLoader(rows, batch_size=batch_size, collate_fn=collate_rows))
    assert trainer.strategy.root_device.type == ("cuda" if accelerator == "gpu" else "cpu")
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


def grpo_batch(prompt_lengths: list[int], completion_lengths: list[int], seed: int = 0, vocab: int = 62):
    """Random ids laid out as the GRPO module lays a batch out: prompts left-padded, completions
    right-padded. Returns (ids, attention mask, number of completion columns)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p, c = max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(0, vocab, (len(prompt_lengths), p + c), generator=g)
    mask = torch.zeros_like(ids)
    for i, (n, m) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, p - n:p + m] = 1
    return ids, mask, c
