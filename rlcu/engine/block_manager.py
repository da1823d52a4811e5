"""Fixed-size KV blocks with reference counts. Forked sequences (the G samples of one prompt) share
the prompt's blocks; a shared partial last block is copied before the first write into it.

Where every attention layer has a sliding window (Mistral v0.1, Phi-3-mini), a sequence's blocks that no later
query can see go back to the pool as it grows (`release_outside`): its table keeps their places, marked
RELEASED, which the attention kernels never read (their key tiles start at the window's first key, rounded
down to a tile, and the release stops a tile short of it)."""
from __future__ import annotations

from collections import deque

from rlcu.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


RELEASED = -1  # a block_table entry whose block went back to the pool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do first
        self.pending_state_copies: list[tuple[int, int]] = []  # (parent, fork) request slots of recurrent state

    @property
    def num_free(self) -> int:
        return len(self.free)

    def tail_has_room(self, seq: Sequence) -> bool:
        """The next token fits in a tail block that `seq` alone holds: a decode step reserves nothing."""
        return bool(seq.num_computed_tokens % self.block_size) and self.ref_counts[seq.block_table[-1]] == 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks to hold `num_tokens` more tokens of `seq` (counting a copy-on-write)."""
        total = blocks_for(seq.num_computed_tokens + num_tokens, self.block_size)
        need = max(0, total - len(seq.block_table))
        if self.shared_partial_tail(seq):
            need += 1
        return need

    def shared_partial_tail(self, seq: Sequence) -> bool:
        return (bool(seq.block_table) and seq.num_computed_tokens % self.block_size != 0
                and self.ref_counts[seq.block_table[-1]] > 1)

    def _take(self) -> int:
        if not self.free:
            raise OutOfBlocks("no free KV block")
        block = self.free.popleft()
        self.ref_counts[block] = 1
        return block

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for `num_tokens` more tokens; the caller checked `blocks_needed` <= `num_free`."""
        if self.shared_partial_tail(seq):
            old = seq.block_table[-1]
            new = self._take()
            self.ref_counts[old] -= 1
            self.pending_copies.append((old, new))
            seq.block_table[-1] = new
        total = blocks_for(seq.num_computed_tokens + num_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take())

    def fork(self, parent: Sequence) -> Sequence:
        child = parent.fork()
        for block in child.block_table[child.released:]:
            self.ref_counts[block] += 1
        return child

    def release_outside(self, seq: Sequence, window: int, tile: int) -> None:
        """Give back the blocks of `seq` wholly before what its next query may read: the keys from `window` - 1
        before it, from a multiple of `tile` tokens (the kernels' key tiles start there)."""
        first_read = max(0, seq.num_computed_tokens + 1 - window) // tile * tile
        end = min(first_read // self.block_size, len(seq.block_table))
        for i in range(seq.released, end):
            self._unref(seq.block_table[i])
            seq.block_table[i] = RELEASED
        seq.released = max(seq.released, end)

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)
        elif self.ref_counts[block] < 0:
            raise AssertionError(f"block {block} freed more often than taken")

    def free_sequence(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table[seq.released:]):
            self._unref(block)
        seq.block_table, seq.released = [], 0
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
