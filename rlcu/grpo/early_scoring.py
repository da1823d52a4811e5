"""Scoring during generation (`score_during_generation`): completions are scored in a worker thread as they
end, while the rollout still decodes the others, so that the score phase after the rollout is left with the
completions that ended last. The worker takes every completion that has ended since its last call: one reward
call while a call runs, many small ones while the rewards keep up.

The rewards then see parts of the batch (each completion with its own prompt and columns, as in the batch):
the same values for every reward that scores each completion on its own (all of rlcu's, and TRL's usual ones),
not for one that compares completions with each other. Reward calls stay one at a time, as after the rollout.
While the worker runs Python, the decode loop waits for the interpreter's lock to be handed over at every GPU
wait: the switch interval is shortened while the scorer is open (`rlcu/engine/threads.py`), so that the loop
gets the lock back within a fraction of a decode step. Rewards that wait without the lock (a sandbox's
subprocess, a judge behind HTTP) leave the decode loop only the worker's own Python to share the lock with
(decoding the completions, assembling each call): on the H200 that lengthened a 32 x 8 rollout by about
0.25 s against the 1 s of scoring it hid (docs/benchmarks.md)."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from rlcu.contracts import Turn
from rlcu.engine.threads import beside_decoding
from rlcu.grpo.batch import ScoredRollout
from rlcu.rewards.base import RewardError

_STOP = -1


class EarlyScorer:
    """`score_rows(rows, completion_ids)` scores the completions of those batch rows. Give `on_finished` to the
    rollout backend, then take `result()`, inside the scorer's context (which runs the worker)."""

    def __init__(self, score_rows: Callable[[list[int], list[list[int]]], ScoredRollout], num_rows: int):
        self._score_rows = score_rows
        self._ids: list[list[int] | None] = [None] * num_rows
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._parts: list[tuple[list[int], ScoredRollout]] = []
        self._error: BaseException | None = None
        self.rows_scored = 0  # so far, by the worker
        self._worker = threading.Thread(target=self._work, name="rlcu-score", daemon=True)
        self._beside = beside_decoding()

    def __enter__(self) -> EarlyScorer:
        self._beside.__enter__()
        self._worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._beside.__exit__(None, None, None)
        self._queue.put(_STOP)  # a worker still in a reward call (an error elsewhere) finishes it, then stops

    def on_finished(self, turn: Turn) -> None:
        """Called from the decode loop: records the completion for the worker."""
        self._ids[turn.request] = list(turn.completion_ids)
        self._queue.put(turn.request)

    def _work(self) -> None:
        stop = False
        while not stop:
            rows = [self._queue.get()]
            while not self._queue.empty():
                rows.append(self._queue.get())
            stop = _STOP in rows
            rows = [r for r in rows if r != _STOP]
            if rows and self._error is None:
                try:
                    self._parts.append((rows, self._score_rows(rows, [self._ids[r] for r in rows])))
                    self.rows_scored += len(rows)
                except BaseException as e:  # raised by result(), in the training step's thread
                    self._error = e

    def result(self, completion_ids: list[list[int]], score_all: Callable[[], ScoredRollout]) -> ScoredRollout:
        """The whole batch's scores, in row order, once the worker has scored what was reported. Completions the
        backend did not report (or reported otherwise than its result) are scored now from `completion_ids`,
        the rollout's. When a reward failed, the batch is scored again by `score_all` (scoring after the
        rollout), which raises what that raises: the same error, numbered by the batch's samples."""
        self._queue.put(_STOP)
        self._worker.join()
        if isinstance(self._error, RewardError):
            return score_all()
        if self._error is not None:
            raise self._error
        by_row = {}
        for rows, scored in self._parts:
            for j, r in enumerate(rows):
                by_row[r] = (scored, j)
        missing = [r for r in range(len(completion_ids))
                   if r not in by_row or self._ids[r] != completion_ids[r]]
        if missing:
            try:
                scored = self._score_rows(missing, [completion_ids[r] for r in missing])
            except RewardError:
                return score_all()
            by_row.update({r: (scored, j) for j, r in enumerate(missing)})
        picks = [by_row[r] for r in range(len(completion_ids))]
        return ScoredRollout([s.prompts[j] for s, j in picks], [s.completions[j] for s, j in picks],
                             torch.stack([s.rewards[j] for s, j in picks]))
