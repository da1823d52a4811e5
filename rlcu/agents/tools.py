"""Tools the model may call: TRL's `tools` (plain functions, sync or `async def`, with type hints and a
Google-style docstring) and an environment's public methods. Each is described to the model by its JSON
schema (transformers' `get_json_schema`, as `apply_chat_template(tools=...)` does) and called with a
timeout; a tool that raises, times out or is unknown answers `{"error": ...}` and counts as a failure.
A tool named in `in_process` runs in a forked process that its timeout kills (`tool_isolation: process`):
a busy tool stops spinning, at the price of what it changes in its process staying there."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlcu.calls import CallInterrupted, call_bounded, call_in_process


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be read; then it is not run


def json_schema(fn: Callable) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises several kinds, all meaning "cannot describe this function"
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model ({e}); a tool needs "
                         "type hints and a Google-style docstring with an Args: section, as in TRL") from e


MAX_RESULT_CHARS = 16_384  # a tool result's text the model reads at most (tool_result_max_chars)


def _text(value, name: str) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001  (an exception whose own __str__ raises)
        return f"tool {name} failed with {type(value).__name__}"


class ToolBox:
    def __init__(self, functions: list[Callable], timeout: float | None = None,
                 stop_requested: Callable[[], bool] | None = None, max_result_chars: int = MAX_RESULT_CHARS,
                 in_process: frozenset[str] = frozenset()):
        self.functions: dict[str, Callable] = {}
        for fn in functions:
            name = getattr(fn, "__name__", None)
            if not callable(fn) or not name:
                raise TypeError(f"a tool must be a named function or method, got {fn!r}")
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self.functions[name] = fn
        self.schemas = [json_schema(fn) for fn in functions]
        self.timeout, self.stop_requested, self.max_result_chars = timeout, stop_requested, max_result_chars
        self.in_process = in_process

    def __bool__(self) -> bool:
        return bool(self.functions)

    def run(self, call: ToolCall) -> tuple[object, bool]:
        """(result, failed): the tool's return value, or {"error": ...} as TRL gives it to the model."""
        if call.error is not None:
            return {"error": call.error}, True
        fn = self.functions.get(call.name)
        if fn is None:
            return {"error": f"Tool {call.name} not found."}, True
        if not isinstance(call.arguments, dict):
            return {"error": f"the arguments of {call.name} must be a JSON object"}, True
        call_fn = call_in_process if call.name in self.in_process else call_bounded
        try:
            result = call_fn(fn, call.arguments, self.timeout, f"tool {call.name!r}", self.stop_requested)
        except CallInterrupted:
            raise
        if isinstance(result, BaseException):
            return {"error": _text(result, call.name)}, True
        if isinstance(result, list):  # content blocks, as TRL passes them
            return result, False
        try:
            text = str(result)
        except Exception as e:  # a result whose __str__ raises: the model is told, the run goes on
            why = f"{type(e).__name__}: {_text(e, call.name)}"
            return {"error": f"the result of tool {call.name} has no text ({why})"}, True
        if len(text) > self.max_result_chars:  # before it is tokenized or kept: a tool can return megabytes
            text = text[:self.max_result_chars] + f" [... {len(text) - self.max_result_chars} more characters cut]"
        return text, False


def tool_message(name: str, result) -> dict:
    """TRL's tool message: a list result (content blocks) as is, anything else as its str()."""
    return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
