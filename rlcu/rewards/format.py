"""Format reward: the completion is exactly a sequence of tagged blocks, by default
`<think>...</think>` then `<answer>...</answer>` (DeepSeek-R1's format)."""
from __future__ import annotations

import re

from rlcu.rewards.base import Reward, completion_text


class FormatTags(Reward):
    name = "format_tags"

    def __init__(self, tags: list[str] | tuple[str, ...] = ("think", "answer"), weight: float = 1.0):
        if not tags:
            raise ValueError("FormatTags needs at least one tag")
        self.tags, self.weight = list(tags), weight
        body = r"\s*".join(rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in self.tags)
        self.pattern = re.compile(rf"^\s*{body}\s*$", re.DOTALL)

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        return [1.0 if self.pattern.match(completion_text(c)) else 0.0 for c in completions]
