"""Tools the model may call: TRL's `tools` (plain functions, sync or `async def`, with type hints and a
Google-style docstring) and an environment's public methods. Each is described to the model by its JSON
schema (transformers' `get_json_schema`, as `apply_chat_template(tools=...)` does) and called with a
timeout; a tool that raises, times out or is unknown answers `{"error": ...}` and counts as a failure."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlcu.calls import CallInterrupted, call_bounded


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


class ToolBox:
    def __init__(self, functions: list[Callable], timeout: float | None = None,
                 stop_requested: Callable[[], bool] | None = None):
        self.functions: dict[str, Callable] = {}
        for fn in functions:
            name = getattr(fn, "__name__", None)
            if not callable(fn) or not name:
                raise TypeError(f"a tool must be a named function or method, got {fn!r}")
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self.functions[name] = fn
        self.schemas = [json_schema(fn) for fn in functions]
        self.timeout, self.stop_requested = timeout, stop_requested

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
        try:
            result = call_bounded(fn, call.arguments, self.timeout, f"tool {call.name!r}", self.stop_requested)
        except CallInterrupted:
            raise
        if isinstance(result, BaseException):
            return {"error": str(result)}, True
        return result, False


def tool_message(name: str, result) -> dict:
    """TRL's tool message: a list result (content blocks) as is, anything else as its str()."""
    return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
