"""Continuous batching. Each step first gives every running sequence its next decode token, then fills
the rest of the token budget with prefill chunks of waiting sequences (chunked prefill). When blocks
run out, the most recently admitted sequence is preempted: its blocks are freed and it waits to be
recomputed from its tokens. Nothing is ever dropped.

After the model has run a step, the scheduler owns what happens next: it forks the samples of
prompts whose prefill completed (`fork_prefilled`), then appends the sampled tokens, applies stops
and finishes sequences (`postprocess`).

In episodes (`parks=True`) a sequence whose turn ends is parked instead of finished: it leaves the
running batch but keeps its KV blocks, so that when it is resumed with appended tokens only those are
prefilled. Parked sequences, and resumed ones waiting behind the head of the queue, give their blocks
back first when the pool runs short (they are recomputed from their tokens when they run again)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from rlcu.contracts import StopStrings
from rlcu.engine.block_manager import BlockManager, blocks_for
from rlcu.engine.sequence import Sequence, Status


class Scheduled(NamedTuple):
    batch: list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)
    decode_only: bool  # no prefill chunk: one token a sequence, and no fork after the step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_strings: StopStrings | None = None, parks: bool = False,
                 on_end: Callable[[Sequence], None] | None = None,
                 before_free: Callable[[Sequence], None] | None = None, window: tuple[int, int] | None = None,
                 state_slots: int = 0):
        """`window`: (keys, tile) where every attention layer sees only its last `keys` keys, read by kernels in tiles
        of `tile` tokens: blocks before them go back to the pool as sequences grow (`BlockManager.release_outside`).
        `state_slots`: a hybrid's recurrent-state slots; a sequence takes one (and its forks theirs) when admitted
        and gives it back when it ends, and a sequence waits for slots as for room in the running batch."""
        self.bm = block_manager
        self.on_end = on_end  # told of each request as it finishes, from the engine's loop: it must be quick
        self.before_free = before_free  # reads what a finished sequence left in its blocks before they go back
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.stop_strings = stop_strings
        self.parks, self.window = parks, window
        self.free_slots = deque(range(state_slots)) if state_slots else None
        self.finished: dict[int, Sequence] = {}  # request index -> its finished sequence
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # turn ended, waiting for the continuation's reply
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens computed by prefill chunks (prompts, appended tokens, recomputes)
        self.version = 0  # the policy version the next sampled tokens are drawn under (streaming GRPO's)

    def add(self, seq: Sequence) -> None:
        tokens = seq.num_prompt_tokens + seq.max_tokens
        if self.window is not None:  # what a step's chunk may hold at once: its window, a tile, the chunk, a block
            tokens = min(tokens, sum(self.window) + self.max_num_batched_tokens + self.bm.block_size)
        worst = blocks_for(tokens, self.bm.block_size)
        if worst > self.bm.num_blocks:
            raise ValueError(f"a request of {seq.num_prompt_tokens} prompt + {seq.max_tokens} new tokens needs "
                             f"{worst} KV blocks but the pool has {self.bm.num_blocks}; give the engine more "
                             "memory (memory_fraction or num_blocks) or lower max_tokens")
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        """Nothing to compute now: no sequence runs or waits (parked ones wait on their continuation)."""
        return not self.waiting and not self.running

    def preempt(self, seq: Sequence) -> None:
        # Only the head of `waiting` may hold blocks (a chunked prefill in progress): the preempted sequence
        # becomes the head, so a partial prefill behind it gives its blocks back and is recomputed too.
        if self.waiting and self.waiting[0].block_table:
            self.bm.free_sequence(self.waiting[0])
        self.bm.free_sequence(seq)
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> Scheduled:
        """This step's batch, decodes first, and whether it is decodes only."""
        batch: list[tuple[Sequence, int]] = []
        budget = self.max_num_batched_tokens
        prefilled = False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier sequence of this loop
            self._release(seq)
            if self.bm.tail_has_room(seq):
                batch.append((seq, 1))  # nothing to reserve
                budget -= 1
                continue
            while self.bm.blocks_needed(seq, 1) > self.bm.num_free:
                if self._reclaim():
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.bm.reserve(seq, 1)
                batch.append((seq, 1))
                budget -= 1
        while self.waiting and budget > 0 and self._admits(self.waiting[0]):
            seq = self.waiting[0]
            self._take_slots(seq)
            self._release(seq)
            chunk = min(seq.num_uncomputed_tokens, budget, self._capacity(seq))
            if chunk <= 0:
                if not self.running and self._reclaim():
                    continue  # nothing running would free blocks: take back those of idle sequences
                break
            self.bm.reserve(seq, chunk)
            batch.append((seq, chunk))
            budget -= chunk
            self.num_prefill_tokens += chunk
            prefilled = True
            if chunk == seq.num_uncomputed_tokens:  # prefill completes: it samples this step and then decodes
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
            else:
                break  # a partial chunk used the rest of the budget or of the pool
        return Scheduled(batch, decode_only=not prefilled)

    def _take_slots(self, seq: Sequence) -> None:
        """A hybrid's sequence, admitted for the first time: its recurrent-state slot and its forks'."""
        if self.free_slots is not None and seq.state_slot is None:
            seq.state_slot = self.free_slots.popleft()
            seq.fork_slots = [self.free_slots.popleft() for _ in range(seq.pending_forks)]

    def _release(self, seq: Sequence) -> None:
        """Before `seq` computes its next tokens: the blocks no query of theirs reads go back (a sliding window)."""
        if self.window is not None and seq.block_table:
            self.bm.release_outside(seq, *self.window)

    def _reclaim(self) -> bool:
        """Free the blocks of one idle sequence: a parked one, else one waiting behind the queue's head."""
        idle = [s for s in self.parked if s.block_table] or [s for s in list(self.waiting)[1:] if s.block_table]
        if not idle:
            return False
        self.bm.free_sequence(idle[-1])
        self.num_preemptions += 1
        return True

    def _admits(self, seq: Sequence) -> bool:
        """Room among the running sequences for `seq` and the samples it will fork, counting the samples still
        to fork from those admitted earlier in this step."""
        forks = sum(s.pending_forks for s in self.running)
        if self.free_slots is not None and seq.state_slot is None and len(self.free_slots) < 1 + seq.pending_forks:
            return False
        return not self.running or len(self.running) + forks + 1 + seq.pending_forks <= self.max_num_seqs

    def _capacity(self, seq: Sequence) -> int:
        """How many more tokens of `seq` fit in the free blocks."""
        bs = self.bm.block_size
        room_in_tail = (-seq.num_computed_tokens) % bs if seq.block_table else 0
        free = self.bm.num_free - (1 if room_in_tail and self.bm.shared_partial_tail(seq) else 0)
        return max(0, room_in_tail + free * bs)

    def fork_prefilled(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """After a step with prefill: each sequence whose prompt is now computed forks its pending samples,
        which share its blocks from here on. Returns (every sequence that samples now, the row of `seqs`
        whose logits each samples from)."""
        owners, rows = [], []
        for row, seq in enumerate(seqs):
            family = [seq]
            for k in range(seq.pending_forks):
                child = self.bm.fork(seq)
                child.request_index = seq.request_index + 1 + k
                if seq.state_slot is not None:
                    child.state_slot = seq.fork_slots[k]
                    self.bm.pending_state_copies.append((seq.state_slot, child.state_slot))
                self.running.append(child)
                family.append(child)
            seq.pending_forks, seq.fork_slots = 0, []
            rows += [row] * len(family)
            owners += family
        return owners, rows

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """Append each sequence's sampled token; finish those that stopped or reached their length, or in
        episodes park them. Returns the sequences parked now."""
        stops, parked = self.stop_strings, []
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.append(token, logprob, self.version)
            if seq.finish_reason is None and stops and stops.hit(seq.completion_token_ids):
                seq.finish_reason = "stop"
            if seq.finish_reason is None:
                continue
            self.running.remove(seq)
            if self.parks:
                seq.status = Status.PARKED
                self.parked.append(seq)
                parked.append(seq)
            else:
                self.end(seq)
        return parked

    def resume(self, seq: Sequence, token_ids: list[int], max_turn_tokens: int | None) -> None:
        """A parked sequence takes its next turn after `token_ids`, which its next prefill computes."""
        self.parked.remove(seq)
        seq.extend(token_ids, max_turn_tokens)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def end(self, seq: Sequence, finish_reason: str | None = None) -> None:
        """The sequence is done (its episode, in episodes): its blocks go back to the pool."""
        if seq.status is Status.PARKED:
            self.parked.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = finish_reason or seq.finish_reason
        if self.before_free is not None:
            self.before_free(seq)
        self.bm.free_sequence(seq)
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None
        self.finished[seq.request_index] = seq
        if self.on_end is not None:
            self.on_end(seq)
