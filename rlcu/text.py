"""Text helpers that both the data loaders and the rewards need (a leaf: it imports nothing of rlcu)."""
from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` (signed, with thousands commas, decimals or a fraction), as written."""
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None
