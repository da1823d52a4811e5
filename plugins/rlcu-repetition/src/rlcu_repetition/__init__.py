"""Repetition penalty reward: minus the fraction of a completion's word n-grams that repeat an earlier
one, scaled by `max_penalty` (so 0 for no repetition, `max_penalty` when every n-gram repeats)."""
from __future__ import annotations


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content", "")) if completion else ""


class RepetitionPenalty:
    name = "repetition_penalty"

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0, weight: float = 1.0):
        if ngram_size < 1 or max_penalty > 0:
            raise ValueError("ngram_size must be >= 1 and max_penalty <= 0")
        self.ngram_size, self.max_penalty, self.weight = ngram_size, max_penalty, weight

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [self.penalty(_text(c)) for c in completions]

    def penalty(self, text: str) -> float:
        words = text.lower().split()
        grams = [tuple(words[i:i + self.ngram_size]) for i in range(len(words) - self.ngram_size + 1)]
        if not grams:
            return 0.0
        return self.max_penalty * (1 - len(set(grams)) / len(grams))
