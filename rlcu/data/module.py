"""PromptDataModule: rows of prompts (a list of dicts or a Hugging Face `datasets.Dataset`) served in
seeded shuffled batches of row dicts, validated at setup so bad data fails before any training."""
from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from rlcu.data.prompts import PROMPT, collate_rows


class PromptDataModule(L.LightningDataModule):
    def __init__(self, train: Sequence[dict] | Any, batch_size: int = 8, shuffle: bool = True, seed: int = 0,
                 required_columns: Sequence[str] = ()):
        super().__init__()
        self.train, self.batch_size, self.shuffle, self.seed = train, batch_size, shuffle, seed
        self.required_columns = list(required_columns)

    def setup(self, stage: str | None = None) -> None:
        if len(self.train) == 0:
            raise ValueError("the training dataset is empty")
        columns = set(self.train.column_names) if hasattr(self.train, "column_names") else set(self.train[0])
        missing = [c for c in [PROMPT, *self.required_columns] if c not in columns]
        if missing:
            raise KeyError(f"the training dataset lacks the column(s) {missing}; it has {sorted(columns)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=self.shuffle, generator=generator,
                          collate_fn=collate_rows)
