"""The score phase of a GRPO step: rewards of each completion (after the rollout, or during it with
`score_during_generation`: `early_scoring.py`), group advantages, the typed `GRPOBatch` and the reward and
completion metrics. A mixin of `GRPOModule` (module.py), whose attributes it reads: `options`, `tokenizer`,
`rewards`, `agent`, `rollout`, `world_size`, `_attached_trainer()`, and Lightning's `trainer`, `global_step`,
`current_epoch`, `device`."""
from __future__ import annotations

import contextlib
import logging

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlcu.agents import EpisodeRunner
from rlcu.data.prompts import decode_completions, is_conversational
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.batch import GRPOBatch, Sampled, ScoredRollout
from rlcu.grpo.early_scoring import EarlyScorer
from rlcu.grpo.metrics import completion_metrics, reward_metrics
from rlcu.rewards.scoring import RewardInterrupted, score
from rlcu.rollout import require

log = logging.getLogger(__name__)


class GRPOScore:
    def _score_step(self, rows: list[dict], sampled: Sampled, scorer: EarlyScorer | None = None):
        """Rewards, advantages and the training batch; which rows train (filter_zero_std_groups); metrics."""
        loss, g = self.options.loss, self.options.sampling.num_generations
        rollout = sampled.batch
        scored = (self.score(rows, sampled) if scorer is None
                  else scorer.result(rollout.completion_ids, lambda: self.score(rows, sampled)))
        rewards = grpo_loss.combine_rewards(scored.rewards, torch.tensor([r.weight for r in self.rewards]))
        _, is_std_zero = grpo_loss.reward_spread(rewards, g, loss.scale_rewards)
        scored.advantages = self.advantage_estimator.advantages(rewards, g, loss.scale_rewards)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        grpo_batch = GRPOBatch.from_rollout(rollout, scored.advantages, pad, loss.mask_truncated_completions)
        keep = ~is_std_zero if loss.filter_zero_std_groups else torch.ones(len(rollout), dtype=torch.bool)
        metrics = reward_metrics(scored.rewards, [r.name for r in self.rewards], rewards, is_std_zero)
        metrics.update(completion_metrics(grpo_batch.lengths, grpo_batch.truncated))
        if sampled.episodes is not None:
            metrics.update(sampled.episodes.metrics())
        if self.world_size > 1 and loss.filter_zero_std_groups:
            # DDP: every rank runs the same micro-batches (each backward is a collective), so the filtered
            # rows stay and lose their loss mask; the step is skipped only when no rank kept anything
            grpo_batch.loss_mask[~keep] = 0
            kept = self.trainer.strategy.reduce(keep.sum().to(self.device), reduce_op="sum")
            keep = torch.full_like(keep, bool(kept > 0))
        return scored, grpo_batch, keep, metrics

    def score(self, rows: list[dict], sampled: Sampled, g: int | None = None) -> ScoredRollout:
        """Each reward of each completion; rows[i]'s columns go to its `g` completions (TRL's contract). An
        episode's completion is its messages after the prompt; rewards also get `environments` (TRL's)."""
        return self.score_completions(rows, sampled.batch.completion_ids, g, sampled.episodes)

    def score_completions(self, rows: list[dict], completion_ids: list[list[int]], g: int | None = None,
                          episodes: EpisodeRunner | None = None) -> ScoredRollout:
        """`score` from the completions' token ids (and the episodes behind them, if any)."""
        g = self.options.sampling.num_generations if g is None else g
        prompts = [r["prompt"] for r in rows for _ in range(g)]
        if episodes is not None:
            completions = episodes.completions
        else:
            texts = decode_completions(self.tokenizer, completion_ids)
            completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                           for p, t in zip(prompts, texts)]
        columns = {k: [r.get(k) for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
        if episodes is not None and episodes.environments is not None:
            columns["environments"] = episodes.environments
        trainer = self._attached_trainer()
        try:
            values = score(self.rewards, prompts, completions, completion_ids, columns,
                           timeout=self.options.faults.reward_timeout, on_error=self.options.faults.on_reward_error,
                           stop_requested=(lambda: trainer.received_sigterm) if trainer else None,
                           trainer_state=self.trainer_state())
        except RewardInterrupted as e:  # SIGTERM while a reward hangs: stop as Lightning stops on SIGTERM
            log.warning("%s; stopping", e)
            raise SIGTERMException from e
        return ScoredRollout(prompts, completions, values)

    def trainer_state(self) -> dict:
        """TRL passes `trainer_state` to rewards for schedules that depend on progress."""
        trainer = self._attached_trainer()
        return {"global_step": self.global_step, "max_steps": trainer.max_steps if trainer else -1,
                "epoch": self.current_epoch}

    def _early_scorer(self, rows: list[dict]):
        """With score_during_generation, what scores completions as they end (`early_scoring.py`)."""
        if not self.options.model.score_during_generation:
            return contextlib.nullcontext()
        return EarlyScorer(lambda indices, ids: self._score_rows(rows, indices, ids),
                           len(rows) * self.options.sampling.num_generations)

    def _score_rows(self, rows: list[dict], indices: list[int], completion_ids: list[list[int]]) -> ScoredRollout:
        """`score` of some of the batch's completions: each with its own prompt and columns."""
        g = self.options.sampling.num_generations
        return self.score_completions([rows[i // g] for i in indices], completion_ids, 1)

    def _check_scoring_during_generation(self, backend) -> None:
        if self.agent is not None:
            raise ValueError("score_during_generation scores single-turn completions as they end; episodes (tools, "
                             "environment_factory) are scored after the rollout: set score_during_generation=false")
        require(backend, "on_finished", "score_during_generation",
                "use rollout: native, or set score_during_generation=false")
