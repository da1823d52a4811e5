"""reasoning_gym: each task's own verifier from reasoning-gym scores the answer between <answer> and </answer>
(the last such pair; none scores 0). Rows come from the `reasoning_gym` data source, whose `rg_entry` column
holds the generated entry the verifier needs. `format_score` is TinyZero's partial credit, as the countdown
reward's: an answer inside the tags scores at least that much, so a small model that never yet answers right
still gives GRPO something to compare. `answer_from="last_number"` scores the completion's last number instead,
for numeric tasks and a model that writes numbers long before it writes tags (SmolLM2-135M on basic_arithmetic:
recipes/reasoning-gym/README.md); format_score does not apply there."""
from __future__ import annotations

import json
import re

from rlcu.rewards.base import Reward, checked_format_score, completion_text, require_column
from rlcu.text import last_number

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_FROM = ("tags", "last_number")


class ReasoningGymScore(Reward):
    name = "reasoning_gym"

    def __init__(self, entry_column: str = "rg_entry", weight: float = 1.0, format_score: float = 0.0,
                 answer_from: str = "tags"):
        if answer_from not in ANSWER_FROM:
            raise ValueError(f"reasoning_gym's answer_from must be one of {', '.join(ANSWER_FROM)}, "
                             f"got {answer_from!r}")
        if answer_from == "last_number" and format_score:
            raise ValueError("reasoning_gym's format_score credits answers inside <answer> tags: it needs "
                             "answer_from='tags', or set format_score to 0 with answer_from='last_number'")
        try:
            import reasoning_gym
        except ImportError as e:
            raise ImportError("the reasoning_gym reward needs the reasoning-gym package: pip install "
                              "'rlcu[reasoning]'") from e
        self.rg, self.entry_column, self.weight = reasoning_gym, entry_column, weight
        self.format_score, self.answer_from = checked_format_score(format_score), answer_from
        self.verifiers: dict = {}

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        entries = require_column(self.name, self.entry_column, kwargs)
        return [self._score(completion_text(c), e) for c, e in zip(completions, entries)]

    def _score(self, text: str, entry) -> float | None:
        if entry is None:
            return None
        entry = json.loads(entry) if isinstance(entry, str) else entry
        answer = self._answer(text)
        if answer is None:
            return 0.0
        task = entry["metadata"]["source_dataset"]
        if task not in self.verifiers:
            self.verifiers[task] = self.rg.get_score_answer_fn(task)
        return max(float(self.verifiers[task](answer, entry)), self.format_score)

    def _answer(self, text: str) -> str | None:
        if self.answer_from == "last_number":
            number = last_number(text)
            return None if number is None else number.replace(",", "")
        found = ANSWER.findall(text)
        return found[-1].strip() if found else None
