"""Calling user code that may hang: rewards, tools and environments. A synchronous function runs in a
daemon thread while the caller waits in short slices: a call past its timeout is left running there
(Python cannot stop a thread) and its result ignored, and since the thread is a daemon, nothing waits for
it when the run ends. `stop_requested` (the trainer's SIGTERM flag) is checked while waiting. An `async
def` function runs on its own event loop, bounded by the same timeout."""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable

POLL_SECONDS = 0.1  # how often a wait looks at its deadline and at `stop_requested`


class CallTimeout(TimeoutError):
    pass


class CallInterrupted(RuntimeError):
    """The run was asked to stop (SIGTERM) while the call was still running."""


def is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def bounded(coroutine, timeout: float | None):
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except asyncio.TimeoutError:
        raise CallTimeout(f"timed out after {timeout} s") from None


def call_bounded(fn: Callable, kwargs: dict, timeout: float | None, name: str,
                 stop_requested: Callable[[], bool] | None = None):
    """fn(**kwargs), or the exception it raised, or a CallTimeout past `timeout` (returned, not raised).
    Raises CallInterrupted when `stop_requested()` turns true while waiting."""
    if is_async(fn):
        try:
            return asyncio.run(bounded(fn(**kwargs), timeout))
        except Exception as e:  # noqa: BLE001 - returned to the caller, which decides
            return e
    done, box = threading.Event(), {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - returned to the caller, which decides
            box["value"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=name, daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done.wait(POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))):
        if stop_requested is not None and stop_requested():
            raise CallInterrupted(f"the run was asked to stop while {name} was running")
        if deadline is not None and time.monotonic() >= deadline:
            return CallTimeout(f"{name} timed out after {timeout} s")
    return box["value"]
