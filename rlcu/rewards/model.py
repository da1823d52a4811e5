"""A reward model (a `...ForSequenceClassification` with one label) as a reward, as TRL's GRPOTrainer runs one:
each prompt and completion joined (a conversation through the reward model's own chat template, text
concatenated), tokenized by the reward model's tokenizer padded on the right without special tokens, scored in
batches with no gradient, the first logit the reward. Given as a hub id, a local folder, or a model object with
its tokenizer (TRL's `reward_processing_classes`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

BATCH = 32  # completions per forward of the reward model


def is_reward_model_folder(path: str) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


class RewardModel:
    def __init__(self, model, tokenizer=None, trust_remote_code: bool = False, batch_size: int = BATCH):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        source = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or ""
        if isinstance(model, str):
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1,
                                                                       trust_remote_code=trust_remote_code)
        if tokenizer is None:
            if not source:
                raise ValueError("a reward model given as an object needs its tokenizer (reward_processing_classes)")
            tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer, self.batch_size = model.eval().requires_grad_(False), tokenizer, batch_size
        self.name = source.rstrip("/").split("/")[-1] or type(model).__name__
        self.template_kwargs: dict = {}  # extra chat-template arguments (a GRPO run's chat_template_kwargs)

    def to(self, device) -> "RewardModel":
        self.model.to(device)
        return self

    def texts(self, prompts: list, completions: list) -> list[str]:
        if prompts and isinstance(prompts[0], list):  # conversations: the reward model's own template
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.template_kwargs)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts, scores = self.texts(prompts, completions), []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(text=texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(device)
            rows = len(batch["input_ids"])
            try:
                logits = self.model(**batch).logits
            except torch.OutOfMemoryError:
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed forward held goes back before the error is handled
                raise torch.OutOfMemoryError(f"reward model {self.name!r} ran out of memory scoring {rows} texts of "
                                             f"up to {batch['input_ids'].shape[1]} tokens at once; lower its "
                                             "batch_size (RewardModel(..., batch_size=...)),") from None
            if logits.ndim != 2 or logits.shape[0] != rows:
                raise ValueError(f"reward model {self.name!r} returned logits of shape {tuple(logits.shape)} for "
                                 f"{rows} texts; a reward model (a ...ForSequenceClassification) returns "
                                 "[texts, labels], the first label being the reward,")
            scores += logits[:, 0].float().tolist()
        return scores
