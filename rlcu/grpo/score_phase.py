"""The score phase of a GRPO step: rewards of each completion (after the rollout, or during it with
`score_during_generation`: `early_scoring.py`), advantages by the run's estimator, the typed `GRPOBatch` and the
reward and completion metrics. `Scoring` is built from the run's options, its rewards, the tokenizer and the
advantage estimator; it asks the Lightning module it runs in only for what `Host` lists. Input: a step's rows
and their `Sampled` rollout; output: a `ScoredStep`."""
from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from typing import NamedTuple, Protocol

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlcu.agents import Episodes
from rlcu.contracts import TrainerState
from rlcu.data.prompts import decode_completions, is_conversational
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.batch import GRPOBatch, Sampled, ScoredRollout
from rlcu.grpo.early_scoring import EarlyScorer
from rlcu.grpo.metrics import completion_metrics, reward_metrics
from rlcu.grpo.options import Options
from rlcu.grpo.registry import AdvantageEstimator
from rlcu.rewards.base import BoundReward
from rlcu.rewards.scoring import RewardInterrupted, score

log = logging.getLogger(__name__)


class Host(Protocol):
    """What scoring asks of the Lightning module it runs in (GRPOModule)."""
    device: torch.device
    world_size: int
    global_rank: int

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def stop_requested(self) -> bool: ...

    def trainer_state(self) -> TrainerState: ...


class RewardLog:
    """TRL's `log_extra(column, values)` and `log_metric(name, value)`, handed to every reward call: columns added
    to the completions table, and scalar metrics averaged over the step and logged beside the built-in ones."""

    def __init__(self):
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}


class ScoredStep(NamedTuple):
    scored: ScoredRollout  # the completions and each reward's value, kept for callbacks
    batch: GRPOBatch  # the training tensors
    keep: torch.Tensor  # [N] bool: the rows that train (filter_zero_std_groups)
    metrics: dict[str, float]  # reward, completion and episode metrics


class Scoring:
    def __init__(self, options: Options, rewards: list[BoundReward], tokenizer, estimator: AdvantageEstimator,
                 host: Host):
        self.options, self.rewards, self.tokenizer, self.estimator, self.host = options, rewards, tokenizer, \
            estimator, host
        self.log = RewardLog()  # this step's, from new_step(); evaluation's calls log into it too

    def new_step(self) -> None:
        """A training step starts: what its rewards log (`log_extra`, `log_metric`) starts empty."""
        self.log = RewardLog()

    def __call__(self, rows: list[dict], sampled: Sampled, scorer: EarlyScorer | None = None) -> ScoredStep:
        """Rewards, advantages and the training batch; which rows train (filter_zero_std_groups); metrics."""
        loss, g = self.options.loss, self.options.sampling.num_generations
        rollout = sampled.batch
        scored = (self.score(rows, sampled) if scorer is None
                  else scorer.result(rollout.completion_ids, lambda: self.score(rows, sampled)))
        weights = torch.tensor([r.weight for r in self.rewards])
        rewards = grpo_loss.combine_rewards(scored.rewards, weights)
        if loss.multi_objective_aggregation == "normalize_then_sum":
            scored.advantages, is_std_zero = grpo_loss.normalize_then_sum(scored.rewards, weights, g)
        else:
            _, is_std_zero = grpo_loss.reward_spread(rewards, g, loss.scale_rewards)
            scored.advantages = self.estimator.advantages(rewards, g, loss.scale_rewards)
        # an agent program's branches (rows after the episodes') train with their episode's advantage
        by_row = torch.arange(len(scored.advantages))
        if sampled.episodes is not None and sampled.episodes.branch_of:
            by_row = torch.cat([by_row, torch.tensor(sampled.episodes.branch_of, dtype=torch.long)])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        grpo_batch = GRPOBatch.from_rollout(rollout, scored.advantages[by_row], pad, loss.mask_truncated_completions)
        keep = ~is_std_zero[by_row] if loss.filter_zero_std_groups else torch.ones(len(rollout), dtype=torch.bool)
        metrics = reward_metrics(scored.rewards, [r.name for r in self.rewards], rewards, is_std_zero)
        metrics.update(completion_metrics(grpo_batch.lengths, grpo_batch.truncated))
        metrics.update(self.log.means())
        scored.extra = dict(self.log.extra)
        if sampled.episodes is not None:
            metrics.update(sampled.episodes.metrics)
        if self.host.world_size > 1:
            grpo_batch, keep = self._same_rows_on_every_rank(grpo_batch, keep)
        if self.host.world_size > 1 and loss.filter_zero_std_groups:
            # DDP: every rank runs the same micro-batches (each backward is a collective), so the filtered
            # rows stay and lose their loss mask; the step is skipped only when no rank kept anything
            grpo_batch.loss_mask[~keep] = 0
            kept = self.host.reduce_sum(keep.sum().to(self.host.device))
            keep = torch.full_like(keep, bool(kept > 0))
        return ScoredStep(scored, grpo_batch, keep, metrics)

    def score(self, rows: list[dict], sampled: Sampled, g: int | None = None) -> ScoredRollout:
        """Each reward of each completion; rows[i]'s columns go to its `g` completions (TRL's contract). An
        episode's completion is its messages after the prompt; rewards also get `environments` (TRL's)."""
        episodes = sampled.episodes
        n = len(sampled.batch) - (len(episodes.branch_of) if episodes is not None else 0)
        return self.score_completions(rows, sampled.batch.completion_ids[:n], g, episodes)

    def _same_rows_on_every_rank(self, batch: GRPOBatch, keep: torch.Tensor) -> tuple[GRPOBatch, torch.Tensor]:
        """DDP runs the same micro-batches on every rank (each backward is a collective): where ranks hold different
        counts of rows (an agent program's branches), each one's is made up to the largest with rows that carry no
        loss (copies of its first, masked)."""
        counts = torch.zeros(self.host.world_size, dtype=torch.long, device=self.host.device)
        counts[self.host.global_rank] = len(batch)
        most = int(self.host.reduce_sum(counts).max())
        if most == len(batch):
            return batch, keep
        extra = most - len(batch)
        batch = batch.rows(torch.cat([torch.arange(len(batch)), torch.zeros(extra, dtype=torch.long)]))
        batch.loss_mask[-extra:] = 0
        return batch, torch.cat([keep, torch.ones(extra, dtype=torch.bool)])

    def score_completions(self, rows: list[dict], completion_ids: list[list[int]], g: int | None = None,
                          episodes: Episodes | None = None) -> ScoredRollout:
        """`score` from the completions' token ids (and the episodes behind them, if any)."""
        g = self.options.sampling.num_generations if g is None else g
        prompts = [r["prompt"] for r in rows for _ in range(g)]
        if episodes is not None:
            completions = list(episodes.completions)  # a text episode's text is decoded here (`Episodes`)
        else:
            texts = decode_completions(self.tokenizer, completion_ids)
            completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                           for p, t in zip(prompts, texts)]
        columns = {k: [r.get(k) for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
        if episodes is not None and episodes.environments is not None:
            columns["environments"] = episodes.environments
        if episodes is not None:
            columns.update(episodes.columns)
        faults = self.options.faults
        try:
            values = score(self.rewards, prompts, completions, completion_ids, columns,
                           timeout=faults.reward_timeout, on_error=faults.on_reward_error,
                           isolation=faults.reward_isolation,
                           stop_requested=self.host.stop_requested, trainer_state=self.host.trainer_state(),
                           log_extra=self.log.log_extra, log_metric=self.log.log_metric)
        except RewardInterrupted as e:  # SIGTERM while a reward hangs: stop as Lightning stops on SIGTERM
            log.warning("%s; stopping", e)
            raise SIGTERMException from e
        return ScoredRollout(prompts, completions, values)

    def early_scorer(self, rows: list[dict]):
        """With score_during_generation, what scores completions as they end (`early_scoring.py`)."""
        if not self.options.model.score_during_generation:
            return contextlib.nullcontext()
        g = self.options.sampling.num_generations
        return EarlyScorer(lambda indices, ids: self.score_completions([rows[i // g] for i in indices], ids, 1),
                           len(rows) * g)
