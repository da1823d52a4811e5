"""Tool use: 1 for an episode in which at least one tool call returned a result (a tool message that is
not `{'error': ...}`), else 0. A shaping reward for small models that must first learn to call a tool at
all; weight it below the task's own reward, so that calling without answering never pays most."""
from __future__ import annotations

from rlcu.rewards.base import Reward


def called_a_tool(completion) -> bool:
    if not isinstance(completion, list):
        return False
    return any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("{'error'") for m in completion)


class ToolUse(Reward):
    name = "tool_use"

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        return [float(called_a_tool(c)) for c in completions]
