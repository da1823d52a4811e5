"""Calling user code that may hang: rewards, tools and environments. A synchronous function runs in a
daemon thread while the caller waits in short slices: a call past its timeout is left running there
(Python cannot stop a thread) and its result ignored, and since the thread is a daemon, nothing waits for
it when the run ends. `stop_requested` (the trainer's SIGTERM flag) is checked while waiting. An `async
def` function runs on its own event loop, bounded by the same timeout.

`call_in_process` runs the function in a forked child instead, which a timeout (or a stop) kills: a reward
that spins past its timeout stops spinning. The child sees the parent's memory as it was at the fork, so the
function needs no pickling, but what it changes there stays there, and its result travels back pickled."""
from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

ISOLATION = ("thread", "process")  # where user code runs: call_bounded's thread or call_in_process's fork
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


def call_in_process(fn: Callable, kwargs: dict, timeout: float | None, name: str,
                    stop_requested: Callable[[], bool] | None = None):
    """fn(**kwargs) in a forked process, as `call_bounded` returns it; past `timeout` (or on a stop) the process
    is killed. An `async def` function, or a platform without fork (Windows), runs as `call_bounded` runs it."""
    if is_async(fn) or "fork" not in multiprocessing.get_all_start_methods():
        return call_bounded(fn, kwargs, timeout, name, stop_requested)
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_child, args=(fn, kwargs, send), name=name, daemon=True)
    child.start()
    send.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not receive.poll(POLL_SECONDS if deadline is None
                               else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))):
            if stop_requested is not None and stop_requested():
                raise CallInterrupted(f"the run was asked to stop while {name} was running")
            if deadline is not None and time.monotonic() >= deadline:
                return CallTimeout(f"{name} timed out after {timeout} s (its process was killed)")
            if not child.is_alive() and not receive.poll():
                return RuntimeError(f"{name} ended its process with exit code {child.exitcode} before returning")
        try:
            _, value = receive.recv()
        except (EOFError, OSError) as e:
            return RuntimeError(f"{name} ended its process before returning ({e})")
        return value
    finally:
        if child.is_alive():
            child.kill()
        child.join(1.0)
        receive.close()


def _child(fn: Callable, kwargs: dict, send) -> None:
    try:
        value = (True, fn(**kwargs))
    except BaseException as e:  # noqa: BLE001 - sent back to the caller, which decides
        value = (False, e)
    try:
        send.send(value)
    except Exception as e:  # noqa: BLE001 - a result (or an error) that does not pickle
        send.send((False, TypeError(f"the result of the call does not pickle: {e}")))
    send.close()
    os._exit(0)  # no atexit handlers, no flushing of the parent's buffers copied at the fork
