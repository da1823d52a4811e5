"""Every N steps, the step's prompts, completions, per-reward scores and advantages: appended to
`completions.jsonl` in the run folder and, with a wandb logger, logged as a table."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as L

from rlcu.rewards.base import completion_text


def transcript(completion) -> str:
    """A completion's text; an episode of several messages as 'role: content' lines."""
    if isinstance(completion, list) and len(completion) > 1:
        return "\n".join(f"{m.get('role')}: {m.get('content', '')}" for m in completion)
    return completion_text(completion)


class CompletionsTable(L.Callback):
    def __init__(self, every_n_steps: int = 10, max_rows: int = 16):
        if every_n_steps < 1 or max_rows < 1:
            raise ValueError("every_n_steps and max_rows must be >= 1")
        self.every_n_steps, self.max_rows = every_n_steps, max_rows
        self._done_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        rollout = getattr(pl_module, "last_rollout", None)
        if rollout is None or step == self._done_step or (step - 1) % self.every_n_steps:
            return
        # trainer.log_dir is a broadcast under DDP: every rank asks, or the ranks' collectives fall out of step
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        self._done_step = step
        names = [r.name for r in pl_module.rewards]
        rows, seen = [], set()
        unique = getattr(getattr(pl_module, "options", None), "evaluation", None)
        unique = bool(unique and unique.log_unique_prompts)  # TRL's: one row per prompt
        for i in range(len(rollout.completions)):
            if len(rows) == self.max_rows:
                break
            if unique and str(rollout.prompts[i]) in seen:
                continue
            seen.add(str(rollout.prompts[i]))
            row = {"step": step, "prompt": completion_text(rollout.prompts[i]),
                   "completion": transcript(rollout.completions[i]),
                   "advantage": float(rollout.advantages[i])}
            for j, name in enumerate(names):
                v = float(rollout.rewards[i, j])
                row[name] = None if v != v else v
            for column, values in (rollout.extra or {}).items():  # a reward's log_extra: one value a completion
                row[column] = values[i] if i < len(values) else None
            rows.append(row)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "completions.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, L.loggers.WandbLogger):
                columns = list(rows[0])
                logger.log_table(key="completions", columns=columns, data=[[r[c] for c in columns] for r in rows],
                                 step=step)
