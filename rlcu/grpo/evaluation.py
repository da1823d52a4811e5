"""Held-out evaluation of a GRPO module: generate with its own rollout backend, greedy and sampled, and
score with its rewards. Plain functions over the module's public methods (`sample`, `sampling_params`,
`score`); Lightning's validation loop and `rlcu eval` call them through the module."""
from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_info

from rlcu.grpo import loss as grpo_loss
from rlcu.grpo.metrics import eval_metrics


@torch.no_grad()
def evaluate(module, rows: list[dict]) -> dict[str, float]:
    """Greedy accuracy, reward and length, and pass@k / mean@k over `eval_num_samples` (TRL's
    `num_generations_eval`) samples at the training temperature. A completion is correct when the accuracy
    reward (`accuracy_reward`, else the first reward) gives it at least 1."""
    correct_at = module.accuracy_index
    greedy = module.sample(rows, 1, module.sampling_params(greedy=True))
    per_func = module.scoring.score(rows, greedy, 1).rewards
    sampled = None
    k = module.options.evaluation.eval_num_samples
    if k > 1:
        samples = module.sample(rows, k, module.sampling_params(seed=module.options.sampling.seed))
        sampled = (module.scoring.score(rows, samples, k).rewards[:, correct_at] >= 1.0).view(len(rows), k)
    weights = torch.tensor([r.weight for r in module.rewards])
    lengths = torch.tensor([len(c) for c in greedy.batch.completion_ids[:len(per_func)]])  # not its branches
    return eval_metrics(per_func[:, correct_at] >= 1.0, grpo_loss.combine_rewards(per_func, weights), lengths, sampled)


def evaluate_all(module, rows: list[dict], batch_size: int) -> dict[str, float]:
    """`evaluate` over all `rows` in batches, averaged by rows."""
    totals: dict[str, float] = {}
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        for name, value in evaluate(module, part).items():
            totals[name] = totals.get(name, 0.0) + value * len(part)
    metrics = {name: value / len(rows) for name, value in totals.items()}
    rank_zero_info("held-out evaluation before training: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return metrics
