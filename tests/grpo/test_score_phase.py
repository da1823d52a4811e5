"""The score phase's part in data parallelism: ranks whose rollouts hold different counts of rows (an agent
program's branches) train as many rows each, the added ones carrying no loss, so that every rank runs the same
micro-batches."""
import torch

from rlcu.contracts import RolloutBatch
from rlcu.grpo.batch import GRPOBatch
from rlcu.grpo.score_phase import Scoring


class Rank:
    """A rank of two whose peer holds `peer_rows` rows: reduce_sum adds the peer's count, as the collective would."""

    def __init__(self, rank: int, peer_rows: int):
        self.world_size, self.global_rank, self.device, self.peer_rows = 2, rank, torch.device("cpu"), peer_rows

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        peer = torch.zeros_like(value)
        peer[1 - self.global_rank] = self.peer_rows
        return value + peer


def batch(rows: int) -> GRPOBatch:
    rollout = RolloutBatch([[1, 2]] * rows, [[3 + i, 4] for i in range(rows)], [[-0.5, -0.25]] * rows,
                           ["stop"] * rows)
    return GRPOBatch.from_rollout(rollout, torch.arange(rows, dtype=torch.float), pad_id=0)


def test_the_rank_with_fewer_rows_makes_them_up_with_rows_that_carry_no_loss():
    scoring = Scoring.__new__(Scoring)
    scoring.host = Rank(1, peer_rows=5)
    mine, keep = batch(3), torch.tensor([True, False, True])
    padded, kept = scoring._same_rows_on_every_rank(mine, keep)
    assert len(padded) == 5 and kept.tolist() == [True, False, True, True, True]
    assert torch.equal(padded.input_ids[:3], mine.input_ids) and torch.equal(padded.loss_mask[:3], mine.loss_mask)
    assert padded.loss_mask[3:].sum() == 0 and padded.attention_mask[3:].sum() > 0  # real tokens, no loss
    scoring.host = Rank(0, peer_rows=2)  # the rank with more rows keeps its own
    same, kept = scoring._same_rows_on_every_rank(mine, keep)
    assert same is mine and kept is keep
