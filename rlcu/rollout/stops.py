"""Stop strings: a completion stops once its decoded text contains one of them. Only the tail is
decoded each step, so the check stays cheap for long completions."""
from __future__ import annotations


def eos_token_ids(config, tokenizer) -> list[int]:
    """Every end-of-sequence id the model's config or its tokenizer declares: a completion stops at any."""
    ids = set(config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class StopStrings:
    def __init__(self, tokenizer, stops: list[str]):
        if stops and tokenizer is None:
            raise ValueError("stop strings need the tokenizer: the backend was set up without one")
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        # enough tokens to spell the longest stop string (every token spells at least one character),
        # plus one more for a token that straddles its start
        self.window = max((len(s) for s in self.stops), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, completion_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(completion_ids[-self.window:], skip_special_tokens=False)
        return any(s in tail for s in self.stops)
