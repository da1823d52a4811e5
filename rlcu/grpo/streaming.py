"""Streaming GRPO (`streaming=True`): the rollout never drains.

Each training step hands its prompts to a rollout stream that stays open between steps (`EngineStream`), then
decodes until `batch` groups (one step's worth) have finished, takes the oldest finished groups, and trains on
them while the others stay in flight. The optimizer step updates the shared parameters in place, between two
decode steps; the next decode step of every running sequence reads the new weights. While the update runs the
KV pool is given back (release_memory), and the sequences in flight are recomputed from their tokens when
decoding resumes (`EngineStream.release`).

How far the stream runs ahead: `max_inflight_tasks` samples (TRL's AsyncGRPOTrainer's name; -1: max(max_staleness,
1) steps' worth), counted in whole steps. Until that many are in flight the first steps only admit their prompts
and decode (no optimizer step, so Lightning's step count does not move). Every step decodes at least its share of
a completion, max_completion_length / steps in flight decode steps, before it looks for finished groups: the
batches in flight stay that far apart, so that the steps take even time, where otherwise the batches admitted
while older ones were finished would start together and finish together, in one long step every few. With one
step's worth (max_staleness=0) the stream is the synchronous rollout: each step decodes its own prompts to the end,
with the same seeds.

Staleness: each token records the policy version (optimizer steps) it was sampled under; a sample's staleness
at training time is the current version minus its oldest token's. A finished group with a sample staler than
`max_staleness` is dropped and counted, and its prompt goes into the stream again, to be sampled anew: every step
trains on one batch of groups within the bound (so ranks stay in lockstep), and every prompt is trained once.
The sampler correction (vllm_importance_sampling_*) weighs the rest by pi_old / pi_sampler token by token, the
sampler being the older policies that drew them.

With decode_steps_during_training, a step hands that many decode steps to a worker thread once it has taken its
groups (`EngineStream.decode_beside`), while it scores and trains on them; they end before its optimizer step, so
their tokens are drawn under the version they record, and count toward the next step's share. The KV pool is then
kept through training. The steps are counted, not timed, so a run stays reproducible.

With score_during_generation, a group is scored in a worker thread as soon as it has finished within
max_staleness, while the stream decodes on (`GroupScorer`); the step then takes the scores it finds, and scores
what it does not find (or everything again, numbered by the step's samples, when a reward failed).

Prompts admitted and not yet trained (in flight, or finished and queued) are the stream's state: a checkpoint
keeps them, and a resumed run submits them again before its next batch, from their prompts, with their seeds,
on the weights it resumes with (their partial completions are not saved). A held-out evaluation does the same:
it closes the stream and the next step submits the pending prompts again."""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlcu.contracts import RolloutBatch
from rlcu.engine.llm_engine import routing_to_host
from rlcu.engine.threads import beside_decoding
from rlcu.grpo.batch import Sampled, ScoredRollout
from rlcu.rollout.base import RolloutStream


def staleness(seq, version: int) -> int:
    """Policy versions between a sample's oldest token and `version`."""
    return version - min(seq.versions, default=version)


@dataclass(eq=False)  # identity: two groups may hold equal rows
class Group:
    row: dict
    batch: int  # which admitted batch it came with (its seed's)
    first: int = -1  # the request index of its first sample in the open stream (-1: not submitted)
    scored: ScoredRollout | None = None  # its samples' scores, from the group scorer
    scoring: bool = False  # handed to the group scorer for the samples it has now


@dataclass
class Taken:
    """One step's groups, oldest first, as the score phase takes them."""
    rows: list[dict]
    sampled: Sampled
    staleness: list[int]  # per sample: policy versions between its oldest token and now
    metrics: dict[str, float] = field(default_factory=dict)
    scorer: Prescored | None = None  # the groups' scores from the group scorer (score_during_generation)


class Host(Protocol):
    """What the streamer asks of the GRPO module (methods, so that the module pickles for ddp_spawn)."""

    def open_stream(self, max_sequences: int) -> RolloutStream: ...

    def encode_rows(self, rows: list[dict]) -> list[list[int]]: ...

    def stream_seed(self, batch: int) -> int: ...

    def score_group(self, row: dict, completion_ids: list[list[int]]) -> ScoredRollout: ...


class GroupScorer:
    """A worker thread that scores groups as the stream finishes them (score_during_generation)."""

    def __init__(self, score_group: Callable[[dict, list[list[int]]], ScoredRollout]):
        self.score_group = score_group
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.worker = threading.Thread(target=self._work, name="rlcu-score-groups", daemon=True)
        self.worker.start()

    def add(self, group: Group, completion_ids: list[list[int]]) -> None:
        group.scoring = True
        self.queue.put((group, completion_ids))

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            group, ids = item
            if self.error is not None:
                continue
            try:
                group.scored = self.score_group(group.row, ids)
            except BaseException as e:  # noqa: BLE001 - the step scores again, and raises what that raises
                self.error = e

    def wait(self, groups: list[Group]) -> None:
        """Until the worker has scored `groups` (every one handed to it), or a reward failed."""
        while any(gr.scored is None for gr in groups) and self.error is None and self.worker.is_alive():
            time.sleep(0.005)

    def close(self) -> None:
        self.queue.put(None)


class Prescored:
    """The step's groups' scores from the group scorer, handed to the score phase as an early scorer is."""

    def __init__(self, groups: list[Group], failed: bool):
        self.groups, self.failed = groups, failed

    def result(self, completion_ids: list[list[int]], score_all: Callable[[], ScoredRollout]) -> ScoredRollout:
        if self.failed or any(gr.scored is None for gr in self.groups):
            return score_all()  # a reward failed, or a group was not scored: the whole step, as after a rollout
        parts = [gr.scored for gr in self.groups]
        return ScoredRollout([p for s in parts for p in s.prompts], [c for s in parts for c in s.completions],
                             torch.cat([s.rewards for s in parts]))


class Streamer:
    def __init__(self, host: Host, num_generations: int, max_staleness: int, max_inflight_tasks: int,
                 score_during_generation: bool = False, max_tokens: int = 0, beside_steps: int = 0):
        """`max_tokens`: a completion's most tokens; each step decodes at least its share of them (0: none);
        `beside_steps`: decode steps beside each step's scoring and training (decode_steps_during_training)."""
        self.host, self.score_during_generation, self.max_tokens = host, score_during_generation, max_tokens
        self.beside_steps, self.beside, self.decoded_beside, self.beside_now = beside_steps, None, 0, 0
        self.scorer: GroupScorer | None = None
        self.g, self.max_staleness, self.max_inflight_tasks = num_generations, max_staleness, max_inflight_tasks
        self.stream: RolloutStream | None = None
        self.pending: list[Group] = []  # admitted and not yet trained, oldest first
        self.batches = 0  # batches admitted so far
        self.dropped_stale = 0  # samples, over the run
        self.dropped_now = 0  # samples, this step

    def steps_in_flight(self, batch: int) -> int:
        """How many steps' worth of groups the stream holds (`batch` groups a step)."""
        if self.max_inflight_tasks < 0:
            return max(self.max_staleness, 1)
        return max(1, math.ceil(self.max_inflight_tasks / (batch * self.g)))

    def step(self, rows: list[dict], version: int, should_stop: Callable[[], bool] | None = None) -> Taken | None:
        """Admit `rows`; once enough is in flight, decode until `len(rows)` groups have finished within
        max_staleness and take them (None while the stream fills)."""
        self.pending += [Group(row, self.batches) for row in rows]
        self.batches += 1
        need, steps = len(rows), self.steps_in_flight(len(rows))
        self._submit(version, steps * need * self.g)
        self.beside_now, self.decoded_beside = self.decoded_beside, 0
        pace = max(-(-self.max_tokens // steps) - self.beside_now, 0)  # the steps decoded beside training count
        self.dropped_now = 0
        if len(self.pending) < steps * need:  # the stream fills: its share of decoding, no training yet
            self._run(lambda: True, pace, should_stop)
            return None
        self._run(lambda: self._ready(version) >= need, pace, should_stop)
        return self._take(need, version)

    def _run(self, ready: Callable[[], bool], pace: int, should_stop: Callable[[], bool] | None) -> None:
        """Decode at least `pace` steps (one step's share of a completion's tokens, so that the batches in flight
        stay a step's share apart instead of finishing together in one long step every `steps` steps), then
        until `ready()`."""
        asked = 0

        def until() -> bool:
            nonlocal asked
            asked += 1
            return asked > pace and ready()

        # the group scorer's Python shares the interpreter with the decode loop
        beside = beside_decoding() if self.scorer is not None else contextlib.nullcontext()
        try:
            with beside:
                self.stream.run(until, should_stop)
        except BaseException:  # interrupted (SIGTERM): the pending prompts stay for the checkpoint
            self.close()
            raise

    def _submit(self, version: int, max_sequences: int = 0) -> None:
        """Open the stream if needed (its pool sized for `max_sequences`) and submit the groups not in it, each
        batch with its own seed."""
        if self.stream is None:
            self.stream = self.host.open_stream(max_sequences)
            self.stream.version = version
            if self.score_during_generation:
                self.scorer = GroupScorer(self.host.score_group)
        fresh = [gr for gr in self.pending if gr.first < 0]
        for b in sorted({gr.batch for gr in fresh}):
            groups = [gr for gr in fresh if gr.batch == b]
            prompts = [ids for ids in self.host.encode_rows([gr.row for gr in groups]) for _ in range(self.g)]
            first = self.stream.submit(prompts, self.host.stream_seed(b))
            for k, gr in enumerate(groups):
                gr.first = first + k * self.g

    def _samples(self, group: Group) -> list | None:
        """The group's finished samples, or None while one of them runs."""
        finished = self.stream.finished()
        samples = [finished.get(group.first + j) for j in range(self.g)]
        return None if group.first < 0 or any(s is None for s in samples) else samples

    def _ready(self, version: int) -> int:
        """Finished groups within max_staleness. A staler one is dropped, counted, and its prompt submitted again
        (every prompt is trained once, on samples of the policies max_staleness allows)."""
        ready, stale = 0, False
        for gr in self.pending:
            samples = self._samples(gr)
            if samples is None:
                continue
            if max(staleness(s, version) for s in samples) <= self.max_staleness:
                ready += 1
                if self.scorer is not None and not gr.scoring:
                    self.scorer.add(gr, [s.completion_token_ids for s in samples])
                continue
            for j in range(self.g):
                self.stream.pop(gr.first + j)
            gr.first, gr.scored, gr.scoring, stale = -1, None, False, True
            self.dropped_now += self.g
        if stale:
            self._submit(version)
        return ready

    def _take(self, need: int, version: int) -> Taken:
        self._ready(version)
        groups = [gr for gr in self.pending if self._samples(gr) is not None][:need]
        taken = {id(gr) for gr in groups}
        self.pending = [gr for gr in self.pending if id(gr) not in taken]
        seqs = [self.stream.pop(gr.first + j) for gr in groups for j in range(self.g)]
        prescored = None
        if self.scorer is not None:
            self.scorer.wait(groups)
            prescored, self.scorer.error = Prescored(groups, self.scorer.error is not None), None
        ages = [staleness(s, version) for s in seqs]
        self.dropped_stale += self.dropped_now
        batch = RolloutBatch(prompt_ids=[s.token_ids[:s.num_prompt_tokens] for s in seqs],
                             completion_ids=[s.completion_token_ids for s in seqs],
                             logprobs=[list(s.logprobs) for s in seqs], finish_reasons=[s.finish_reason for s in seqs],
                             routing=routing_to_host(seqs))
        steps, decode_batch = self.stream.take_stats()
        metrics = {"streaming/staleness_mean": sum(ages) / len(ages), "streaming/staleness_max": float(max(ages)),
                   "streaming/dropped_stale": float(self.dropped_now),
                   "streaming/dropped_stale_total": float(self.dropped_stale),
                   "streaming/queue_groups": float(self._ready(version)),
                   "streaming/in_flight": float(self.stream.in_flight),
                   "streaming/decode_steps": float(steps), "streaming/decode_batch_mean": decode_batch}
        if self.beside_steps:  # of streaming/decode_steps, those decoded beside the previous step's training
            metrics["streaming/decode_steps_beside"] = float(self.beside_now)
        return Taken([gr.row for gr in groups], Sampled(batch), ages, metrics, prescored)

    def decode_beside(self) -> None:
        """After `step` took its groups: start the decode steps that run beside scoring and training."""
        if self.beside_steps and self.stream is not None and self.stream.in_flight:
            self.beside = self.stream.decode_beside(self.beside_steps)

    def wait_beside(self) -> None:
        """Before the parameters change: the decode steps beside training are done (at once if none run)."""
        if self.beside is not None:
            beside, self.beside = self.beside, None
            self.decoded_beside = beside.wait()

    def updated(self, version: int) -> None:
        """The optimizer stepped: the tokens sampled from now on are drawn under `version`."""
        if self.stream is not None:
            self.stream.version = version

    def close(self) -> None:
        """Close the stream; what was pending is submitted again (from its prompts) when the next step opens it."""
        try:
            self.wait_beside()
        finally:
            self._close()

    def _close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        for gr in self.pending:
            gr.first, gr.scored, gr.scoring = -1, None, False

    def state_dict(self) -> dict:
        return {"pending": [(gr.row, gr.batch) for gr in self.pending], "batches": self.batches,
                "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.pending = [Group(row, batch) for row, batch in state["pending"]]
        self.batches, self.dropped_stale = state["batches"], state["dropped_stale"]
