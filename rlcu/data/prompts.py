"""Prompt rows and their tokenisation. A row is a dict with a `prompt` (text, or chat messages
[{'role': ..., 'content': ...}]) and any other columns, which reach the rewards unchanged."""
from __future__ import annotations

from typing import Any

PROMPT = "prompt"


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def encode_prompt(tokenizer, prompt: Any, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt, as TRL's GRPOTrainer makes them: chat messages go through the tokenizer's chat
    template with the generation prompt and nothing added (the template writes its own BOS); plain text is
    tokenised with the tokenizer's special tokens, so a base model that needs its BOS (Gemma, Llama) gets it."""
    return encode_prompts(tokenizer, [prompt], chat_template_kwargs)[0]


def encode_prompts(tokenizer, prompts: list[Any], chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """`encode_prompt` of each prompt, tokenised in one call per kind (chat, text). A fast tokenizer whose backend
    has no truncation or padding of its own hands the whole list to that backend: transformers' per-text
    conversions cost more than the tokenisation itself (the calculator recipe's prompts: half the time,
    docs/benchmarks.md)."""
    texts = [prompt_text(tokenizer, p, chat_template_kwargs) for p in prompts]
    chat = [is_conversational(p) for p in prompts]
    encoded = {kind: iter(_encode(tokenizer, [t for t, c in zip(texts, chat) if c == kind], special=not kind))
               for kind in set(chat)}
    return [next(encoded[c]) for c in chat]


def _encode(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=special)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def prompt_text(tokenizer, prompt: Any, chat_template_kwargs: dict | None = None) -> str:
    """What the tokenizer reads for a prompt: chat messages rendered by its template (with TRL's
    `chat_template_kwargs`, e.g. {enable_thinking: false}), or the text itself."""
    if is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the prompt is a list of chat messages but the tokenizer has no chat template; "
                             "give plain-text prompts (the embedded arithmetic task: dataset_args {chat: false}) or a "
                             "tokenizer with a chat_template")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    if isinstance(prompt, str):
        return prompt
    raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def decode_completions(tokenizer, completion_ids: list[list[int]]) -> list[str]:
    """Completion texts, special tokens skipped: what `tokenizer.batch_decode` returns. A fast tokenizer
    that does no clean-up after decoding gives the whole batch to its Rust backend in one call, without
    transformers' per-sequence Python loop and type checks (about a third of the time at 256 x 512
    tokens, on a part of the step that holds the GPU up)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch([list(ids) for ids in completion_ids], skip_special_tokens=True)
    return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)


def as_rows(batch) -> list[dict]:
    """Accept a list of row dicts (rlcu's collate) or a dict of columns (torch's default collate)."""
    if isinstance(batch, dict):
        if PROMPT not in batch:
            raise KeyError(f"the batch has no {PROMPT!r} column; columns: {sorted(batch)}")
        n = len(batch[PROMPT])
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    rows = list(batch)
    for r in rows:
        if not isinstance(r, dict) or PROMPT not in r:
            cols = sorted(r) if isinstance(r, dict) else type(r).__name__
            raise KeyError(f"every row needs a {PROMPT!r} column; got {cols}")
    return rows


def collate_rows(rows: list[dict]) -> list[dict]:
    return list(rows)
