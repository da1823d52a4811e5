"""PromptDataModule: prompt rows served in seeded, shuffled batches of row dicts, validated at setup so
bad data fails before any training step.

`dataset` is an embedded task ('arithmetic', 'countdown'), a loader ('gsm8k', 'math'), a hub name or
local files with a 'prompt' column, or rows given directly (a list of dicts or a `datasets.Dataset`)."""
from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from rlcu.data.prompts import PROMPT, collate_rows, is_conversational
from rlcu.data.rows import RowView
from rlcu.hparams import not_plain

log = logging.getLogger(__name__)


def data_parallel_rank(trainer) -> tuple[int, int]:
    """(rank, ranks) among the processes that train on different rows: every process under DDP and FSDP; one
    per tensor-parallel group, whose ranks share their rows (Lightning's `distributed_sampler_kwargs`)."""
    if trainer is None:
        return 0, 1
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None)
    if kwargs is None:
        return trainer.global_rank, trainer.world_size
    return kwargs["rank"], kwargs["num_replicas"]


class EpochSampler(DistributedSampler):
    """Row order from the seed and the epoch alone, so any epoch's order can be rebuilt; a resumed run
    starts its epoch after the batches it had already trained on (Lightning calls `set_epoch`).

    Under DDP each rank takes every `world`-th row of that one order, so the ranks' batches together are
    the batch a single process would train on. It is a DistributedSampler so that Lightning keeps it."""

    def __init__(self, num_rows: int, shuffle: bool, seed: int, rank: int = 0, world: int = 1):
        self.num_rows, self.shuffle, self.seed, self.rank, self.num_replicas = num_rows, shuffle, seed, rank, world
        self.epoch, self._resume = 0, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, rows_done: int) -> None:
        self._resume = (epoch, rows_done)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = (torch.randperm(self.num_rows, generator=generator) if self.shuffle
                 else torch.arange(self.num_rows)).tolist()
        order += order[:len(self) * self.num_replicas - len(order)]  # every rank gets as many rows
        mine = order[self.rank::self.num_replicas]
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        return iter(mine[skip:])

    def __len__(self) -> int:
        return -(-self.num_rows // self.num_replicas)


class ResumableLoader(DataLoader):
    """The training loader resumes mid-epoch: `train_dataloader` starts its sampler at the fit loop's restored
    position (epoch and batches done), so the checkpoint's loop progress is its state. These two methods tell
    Lightning so (it warns about loaders without them); the state itself lives in the loop."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


HOLD_OUT_BY = ("prompt", "row")


class PromptDataModule(L.LightningDataModule):
    def __init__(self, dataset: Any = "arithmetic", dataset_args: dict[str, Any] | None = None, split: str = "train",
                 batch_size: int = 8, shuffle: bool = True, seed: int = 0, max_samples: int | None = None,
                 required_columns: Sequence[str] = (), as_chat: bool = False, system_prompt: str | None = None,
                 val_size: int = 0, hold_out_by: str = "prompt", val_split: str | None = None,
                 val_batch_size: int = 256):
        """`val_size`: rows held out for evaluation, the last of the training split's, or with `val_split`
        (a named dataset's other split, such as GSM8K's 'test') the first of that split's.
        `hold_out_by`: what a training row may not share with a held-out one: its `prompt` (the default: no
        question is both trained on and evaluated, whatever its other columns), or the whole `row` (for tasks
        whose rows share a prompt and differ in hidden columns, as the games of an environment do).
        `val_batch_size`: held-out prompts per evaluation batch, by default up to 256 at once: the engine
        schedules a batch as one rollout, so a held-out set in batches of the training `batch_size` would
        decode its longest completion once per small batch."""
        super().__init__()
        if hold_out_by not in HOLD_OUT_BY:
            raise ValueError(f"hold_out_by must be one of {HOLD_OUT_BY}, got {hold_out_by!r}")
        # the seed logged as data_seed: Lightning merges the data module's hyperparameters with the GRPO module's,
        # whose `seed` (the sampler's, 42 by default as TRL's) is another setting, and refuses a run where they differ
        self.save_hyperparameters(ignore=[*not_plain(dataset=dataset), "seed"])
        self.save_hyperparameters({"data_seed": seed})
        self.dataset, self.dataset_args, self.split = dataset, dataset_args, split
        self.batch_size, self.shuffle, self.seed, self.max_samples = batch_size, shuffle, seed, max_samples
        self.required_columns, self.as_chat, self.system_prompt = list(required_columns), as_chat, system_prompt
        self.val_size, self.hold_out_by, self.val_split = val_size, hold_out_by, val_split
        self.val_batch_size = val_batch_size
        self.train_set, self.val_set = None, None
        self.trained_batch_size: int | None = None  # the batch size a resumed checkpoint trained with

    def state_dict(self) -> dict:
        """Saved in checkpoints: a run resumed with another batch_size still starts after the rows it trained on."""
        return {"batch_size": self.batch_size}

    def load_state_dict(self, state_dict: dict) -> None:
        self.trained_batch_size = state_dict.get("batch_size")

    def setup(self, stage: str | None = None) -> None:
        if not self.val_size and stage == "fit" and self.trainer is not None:
            self.trainer.limit_val_batches = 0  # nothing held out: no evaluation during training
        if self.train_set is not None:
            return
        if self.batch_size < 1 or self.val_batch_size < 1:
            raise ValueError(f"batch_size and val_batch_size must be >= 1, got {self.batch_size} and "
                             f"{self.val_batch_size}")
        rows = self._build(self.split)
        if self.max_samples is not None:
            keep = min(self.max_samples, len(rows))
            rows = rows.select(range(keep)) if hasattr(rows, "select") else rows[:keep]
        if len(rows) == 0:
            raise ValueError(f"the training dataset {self.dataset if isinstance(self.dataset, str) else ''} is empty")
        columns = set(rows.column_names) if hasattr(rows, "column_names") else set(rows[0])
        missing = [c for c in [PROMPT, *self.required_columns] if c not in columns]
        if missing:
            fix = ("Rename a column to 'prompt', or use a loader such as 'gsm8k' that builds it" if PROMPT in missing
                   else "Rename columns to those names, or drop them from data.required_columns")
            raise KeyError(f"the training dataset lacks the column(s) {missing}; it has {sorted(columns)}. {fix}.")
        self.train_set, self.val_set = self._hold_out(rows, self._val_rows())

    def _build(self, split: str):
        rows = self.dataset
        if isinstance(rows, str) or (isinstance(rows, list) and rows and all(isinstance(x, str) for x in rows)):
            from rlcu.data.sources import build_dataset

            args = dict(self.dataset_args or {})
            if split != self.split:  # the held-out split: the split asked for here replaces dataset_args' own
                args.pop("split", None)
            return build_dataset(rows, args, split)
        if self.dataset_args:
            raise ValueError("dataset_args apply only when dataset is a name or files, not to rows given directly")
        return rows

    def _val_rows(self) -> list[dict] | None:
        """The first `val_size` rows of `val_split`, or None to hold out the training split's last rows."""
        if self.val_split is None:
            return None
        from rlcu.data.sources import TASKS

        if not isinstance(self.dataset, str) or self.dataset in TASKS or ":" in self.dataset:
            raise ValueError(f"val_split={self.val_split!r} needs a dataset with splits (a loader such as 'gsm8k', "
                             "a hub name or files); generated or given rows are held out with val_size alone")
        if self.val_size < 1:
            raise ValueError(f"val_split={self.val_split!r} needs val_size >= 1: how many of its rows to evaluate")
        rows = self._build(self.val_split)
        if self.val_size > len(rows):
            raise ValueError(f"val_size {self.val_size} is more than the {len(rows)} rows of split "
                             f"{self.val_split!r}; set val_size <= {len(rows)}")
        return RowView(rows)[:self.val_size]

    def _hold_out(self, rows, val: list[dict] | None) -> tuple[RowView, list[dict] | None]:
        """The held-out rows are `val` (another split's, untransformed) or the last `val_size` rows; training never
        sees a prompt (or with hold_out_by=row, a row) that is in them. Both come out as chat prompts where
        as_chat or system_prompt asks; the training rows as a view, converted when read."""
        transform = self._to_chat if self.as_chat or self.system_prompt else None
        view = RowView(rows)
        if val is None:
            if self.val_size < 0 or self.val_size >= len(rows):
                raise ValueError(f"val_size must be in [0, {len(rows)}) for {len(rows)} rows, got {self.val_size}")
            if not self.val_size:
                return RowView(rows, transform=transform), None
            cut = len(rows) - self.val_size
            val, view = view[cut:], RowView(rows, range(cut))

        def key(value) -> str:
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)

        if self.hold_out_by == "prompt":
            held, keys = {key(r[PROMPT]) for r in val}, map(key, view.column(PROMPT))
        else:
            held, keys = {key(r) for r in val}, map(key, view)
        train = RowView(rows, [view.base_index(i) for i, k in enumerate(keys) if k not in held], transform)
        if not len(train):
            raise ValueError(f"no training rows are left once the held-out {self.hold_out_by}s are removed; lower "
                             "val_size" + (", or set hold_out_by: row if rows share a prompt and differ in other "
                                           "columns" if self.hold_out_by == "prompt" else ""))
        return train, [transform(r) for r in val] if transform else val

    def _to_chat(self, row: dict) -> dict:
        prompt = row[PROMPT]
        messages = prompt if is_conversational(prompt) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return dict(row, prompt=messages)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        trainer = self.trainer
        rank, world = data_parallel_rank(trainer)
        sampler = EpochSampler(len(self.train_set), self.shuffle, self.seed, rank, world)
        loop = trainer.fit_loop if trainer is not None else None
        if loop is not None and loop.epoch_loop.batch_progress.current.processed:  # resuming inside an epoch
            done = loop.epoch_loop.batch_progress.current.processed
            trained = self.trained_batch_size or self.batch_size  # the batches done were of the checkpoint's size
            if trained != self.batch_size:
                log.info("resuming with batch_size %d after %d batches of %d: the epoch goes on after row %d",
                         self.batch_size, done, trained, done * trained)
            sampler.resume_at(loop.epoch_progress.current.processed, done * trained)
        return ResumableLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_rows)

    def val_dataloader(self) -> DataLoader:
        """The held-out rows in order."""
        self.setup()
        if self.val_set is None:
            raise ValueError("evaluation needs a held-out split: set data.val_size (e.g. --data.val_size=200)")
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, collate_fn=collate_rows)
