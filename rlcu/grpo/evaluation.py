"""Held-out evaluation for the GRPO module: Lightning's validation loop (and `rlcu eval`) generates
with the module's own rollout backend, greedy and sampled, and scores with its rewards."""
from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_info

from rlcu.data.prompts import as_rows
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.metrics import eval_metrics


class HeldOutEvaluation:
    """Mixed into GRPOModule; uses its hparams, rewards, `_encode`, `_sampling`, `_generate`, `_score` and
    `_world_size`."""

    def validation_step(self, batch, batch_idx):
        """Greedy accuracy, reward and length, and pass@k / mean@k over `eval_num_samples` samples at the
        training temperature. A completion is correct when the accuracy reward (`accuracy_reward`, else
        the first reward) gives it at least 1."""
        rows = as_rows(batch)
        metrics = self.evaluate(rows)
        sync = self._world_size > 1  # each rank holds a share of the rows
        for name, value in metrics.items():
            self.log(name, value, batch_size=len(rows), on_epoch=True, prog_bar=name == "eval/accuracy", sync_dist=sync)

    @torch.no_grad()
    def evaluate(self, rows: list[dict]) -> dict[str, float]:
        hp = self.hparams
        prompt_ids = [self._encode(r["prompt"], i) for i, r in enumerate(rows)]
        out = self._generate(prompt_ids, self._sampling(greedy=True))
        per_func, _ = self._score(rows, out, 1)
        sampled = None
        k = hp.eval_num_samples
        if k > 1:
            samples = self._generate([p for p in prompt_ids for _ in range(k)], self._sampling(seed=hp.seed))
            sampled = (self._score(rows, samples, k)[0][:, self.accuracy_index] >= 1.0).view(len(rows), k)
        weights = torch.tensor([r.weight for r in self.rewards])
        lengths = torch.tensor([len(c) for c in out.completion_ids])
        return eval_metrics(per_func[:, self.accuracy_index] >= 1.0, grpo_loss.combine_rewards(per_func, weights),
                            lengths, sampled)

    def _log_eval_at_start(self, rows: list[dict], batch_size: int) -> None:
        totals: dict[str, float] = {}
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            for name, value in self.evaluate(part).items():
                totals[name] = totals.get(name, 0.0) + value * len(part)
        metrics = {name: value / len(rows) for name, value in totals.items()}
        rank_zero_info("held-out evaluation before training: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        for logger in self.loggers:
            logger.log_metrics(metrics, step=0)

