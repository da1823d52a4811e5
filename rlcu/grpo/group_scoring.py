"""Scoring during generation (`score_during_generation`): each group of G completions is scored in a worker
thread as soon as its last completion ends, while the rollout still decodes the other groups, so that the
score phase after the rollout is left with only the groups that finished last.

The rewards see a group at a time instead of the whole batch: the same values for every reward that scores
each completion on its own (all of rlcu's, and TRL's usual ones), not for one that compares completions across
groups. One worker keeps the reward calls one at a time, in the order the groups finish, as after the rollout.
While the worker runs Python, the decode loop waits for the interpreter's lock to be handed over at every GPU
wait: the switch interval is shortened for the rollout (`SWITCH_INTERVAL_S`), so that it gets the lock back
within a fraction of a decode step."""
from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rlcu.contracts import Turn
from rlcu.grpo.batch import ScoredRollout

SWITCH_INTERVAL_S = 2e-4  # CPython's default, 5 ms, is longer than a decode step of 64 sequences (about 2 ms)


class GroupScorer:
    """`score_group(k, completion_ids)` scores group k (rows k*g .. k*g + g - 1) from its completions' token ids.
    Give `on_finished` to the rollout backend, then take `result()`; use it as a context manager, which also
    shortens the switch interval while it is open."""

    def __init__(self, score_group: Callable[[int, list[list[int]]], ScoredRollout], num_groups: int, g: int):
        self._score_group, self._g = score_group, g
        self._ids: list[list[int] | None] = [None] * (num_groups * g)
        self._left = [g] * num_groups  # completions of each group still decoding
        self._futures: list[Future | None] = [None] * num_groups
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rlcu-score")
        self._interval = None

    def __enter__(self) -> GroupScorer:
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        return self

    def __exit__(self, *exc) -> None:
        sys.setswitchinterval(self._interval)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def on_finished(self, turn: Turn) -> None:
        """Called from the decode loop: records the completion and, for a group's last, hands the group over."""
        k = turn.request // self._g
        self._ids[turn.request] = list(turn.completion_ids)
        self._left[k] -= 1
        if self._left[k] == 0:
            self._futures[k] = self._pool.submit(self._score_group, k, self._ids[k * self._g:(k + 1) * self._g])

    def result(self, completion_ids: list[list[int]]) -> ScoredRollout:
        """The whole batch's scores, in row order; a reward's error is raised here, as scoring after the rollout
        raises it. A group the backend did not report (or a report that disagrees with the rollout's
        completions) is scored now from `completion_ids`, the rollout's."""
        parts = []
        for k, future in enumerate(self._futures):
            ids = completion_ids[k * self._g:(k + 1) * self._g]
            reported = future is not None and self._ids[k * self._g:(k + 1) * self._g] == ids
            parts.append(future.result() if reported else self._score_group(k, ids))
        return ScoredRollout([p for s in parts for p in s.prompts], [c for s in parts for c in s.completions],
                             torch.cat([s.rewards for s in parts]))

    @property
    def groups_scored_early(self) -> int:
        """Groups whose scoring had finished by now (for `result()`, the ones that were hidden by the rollout)."""
        return sum(f is not None and f.done() for f in self._futures)
