"""DAPO's soft overlong punishment: 0 up to `max_length - cache_length` tokens, then a linear penalty
reaching -1 at `max_length`, and -1 beyond."""
from __future__ import annotations

from rlcu.rewards.base import Reward


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


class OverlongPenalty(Reward):
    name = "overlong_penalty"

    def __init__(self, max_length: int = 256, cache_length: int = 64, weight: float = 1.0):
        if not 0 < cache_length <= max_length:
            raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
        self.max_length, self.cache_length, self.weight = max_length, cache_length, weight

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        return [overlong_penalty(len(ids), self.max_length, self.cache_length) for ids in completion_ids]
