"""Tool use: 1 for an episode in which a tool call returned a result (a tool message that is not
`{'error': ...}`) and the model then answered (the last message is the assistant's, with no further tool
call), else 0. A shaping reward for small models that must first learn to call a tool at all; an episode
that calls again and again, or runs out of tokens, earns nothing. Weight it below the task's own reward,
so that calling and answering wrongly never pays most."""
from __future__ import annotations

from rlcu.rewards.base import Reward


def used_a_tool_then_answered(completion) -> bool:
    if not isinstance(completion, list) or not completion:
        return False
    result = any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("{'error'") for m in completion)
    last = completion[-1]
    return result and last.get("role") == "assistant" and not last.get("tool_calls") and bool(last.get("content"))


class ToolUse(Reward):
    name = "tool_use"

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        return [float(used_a_tool_then_answered(c)) for c in completions]
