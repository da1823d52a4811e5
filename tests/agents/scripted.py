"""A scripted tool-calling "model" for the agent tests: a rollout backend whose turns are fixed texts,
chosen by the conversation so far (a function of the decoded history), run turn by turn."""
from __future__ import annotations

from rlcu.contracts import RolloutBatch
from rlcu.rollout import Capabilities
from rlcu.rollout.turns import generate_in_turns


class ScriptedRollout:
    """`script(history_text, turn_index) -> the assistant's next turn (text, ending with its end token)`."""

    capabilities = Capabilities(continuation=True)  # it runs episodes itself, turn by turn

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.requests: list[list[int]] = []  # every turn's request, for tests that look at what was sent

    def setup(self, policy, tokenizer):
        pass

    def generate(self, prompt_token_ids, sampling, continuation=None):
        if continuation is not None:
            return generate_in_turns(self.generate, prompt_token_ids, sampling, continuation)
        completions = []
        for ids in prompt_token_ids:
            self.requests.append(list(ids))
            text = self.tokenizer.decode(ids)
            turn = text.count("<|im_start|>assistant") - 1
            out = self.tokenizer(self.script(text, turn), add_special_tokens=False)["input_ids"][:sampling.max_tokens]
            completions.append(out)
        eos = self.tokenizer.eos_token_id
        reasons = ["stop" if c and c[-1] == eos else "length" for c in completions]
        return RolloutBatch([list(p) for p in prompt_token_ids], completions, [[-0.5] * len(c) for c in completions],
                            reasons)

    def release(self):
        pass

    def on_weights_updated(self):
        pass


def call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'
