"""Guess the number: the user thinks of an integer in [low, high]; after each guess the assistant hears
"higher" or "lower", until it is right or out of guesses. The reward is 1 for a solved game and 0 for an
unsolved one (the success rate); the turns it took are logged as episodes/mean_turns."""
from __future__ import annotations

import random
import re

from rlcu.agents import TextEnvironment

__all__ = ["GuessNumber", "games"]
NUMBER = re.compile(r"-?\d+")
PROMPT = ("I am thinking of a whole number between {low} and {high}. Guess it: answer with one number. After each "
          "guess I will say higher or lower.")


class GuessNumber(TextEnvironment):
    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 7):
        if low >= high or max_guesses < 1:
            raise ValueError(f"GuessNumber needs low < high and max_guesses >= 1, got {low}, {high}, {max_guesses}")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.target, self.guesses, self.solved = low, 0, False

    def reset(self, target: int | None = None, **row) -> None:
        """A new game; `target` (a dataset column) fixes the number, else it is drawn at random."""
        self.done, self.guesses, self.solved = False, 0, False
        self.target = int(target) if target is not None else random.randint(self.low, self.high)
        return None

    def step(self, message: str) -> str:
        found = NUMBER.findall(message)
        if not found:
            self.done = self.guesses + 1 >= self.max_guesses
            self.guesses += 1
            return "Answer with one whole number."
        guess = int(found[-1])
        self.guesses += 1
        if guess == self.target:
            self.solved = self.done = True
            return "Correct!"
        self.done = self.guesses >= self.max_guesses
        return "Higher." if guess < self.target else "Lower."

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


def games(n: int = 1000, seed: int = 0, low: int = 1, high: int = 100) -> list[dict]:
    """Dataset rows: the game's opening prompt, its hidden `target`, and a `game` number that makes each row
    a distinct game (held out by row, `hold_out_by: row`, a split holds games training never plays, though
    targets recur)."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": PROMPT.format(low=low, high=high)}],
             "target": rng.randint(low, high), "game": i} for i in range(n)]
