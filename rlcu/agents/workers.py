"""Agent programs in processes of their own (`agent_processes`): each rollout's episodes are spread over N worker
processes, each running its share on an event loop of its own, and the endpoint's HTTP side runs in one more
(`endpoint.EndpointProcess`). In the trainer's process, the programs' Python (an HTTP client parsing JSON, an agent
framework) and the endpoint's share one interpreter lock with the engine's thread, whose Python runs between its
steps: every call then waits for the lock on both sides. In their own processes their work runs beside the engine,
and a call costs the trainer's process one message in and one out.

The processes start once (the spawn method: safe beside CUDA and threads) and serve every rollout until `close()`.
A program, its rows and what it returns cross by pickle: a program is a function or object importable by name (or
a picklable object); a program or row that does not pickle is refused before the rollout starts.

`agent_processes: -1` (the default) picks for the run (`resolve_processes`): worker processes where spawning them is
safe and the program pickles, a thread otherwise. Spawning is safe where the process's main module is guarded:
the `rlcu` command's (`started_from_cli`). A script of the user's may not be, and a spawned process re-runs an
unguarded script's top level, a second training run; so the Python API keeps the thread unless asked."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from rlcu.agents.endpoint import EndpointProcess, Handler, Served, watch

log = logging.getLogger(__name__)
AUTO = -1
_main_spawns_safely = False


@contextlib.contextmanager
def started_from_cli():
    """Marks the `rlcu` command's run: its main module is rlcu's own, which a spawned process may import again."""
    global _main_spawns_safely
    before, _main_spawns_safely = _main_spawns_safely, True
    try:
        yield
    finally:
        _main_spawns_safely = before


def resolve_processes(setting: int, program: object) -> int:
    """The worker processes a run's agent programs get: `setting` where it is 0 or more; for AUTO (-1), one per
    4 CPU cores, 1 to 4, where the main module spawns safely and `program` pickles, else 0 (a thread)."""
    if setting != AUTO:
        return setting
    if not _main_spawns_safely:
        return 0
    try:
        pickle.dumps(program)
    except Exception as e:  # noqa: BLE001 - pickle raises several kinds
        log.info("agent_processes: -1 runs %s on a thread of this process: it does not pickle (%s)",
                 getattr(program, "__qualname__", type(program).__name__), e)
        return 0
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass
class _Run:
    """One rollout's episodes in the workers: `ended(index, result, error)` is called from the pool's listener
    thread as each program returns; `done` is set once every worker has finished the rollout's programs."""
    number: int
    ended: Callable[[int, object, BaseException | None], None]
    unfinished: dict[int, set[int]] = field(default_factory=dict)  # a worker's episodes that have not ended
    pending: set[int] = field(default_factory=set)  # the workers still running this rollout's programs
    done: threading.Event = field(default_factory=threading.Event)


class ProgramWorkers:
    """`processes` worker processes that run agent programs' episodes, rollout after rollout."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"agent_processes must be >= 1 for worker processes, got {processes}")
        self.processes = processes
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.Process] = []
        self._run: _Run | None = None
        self._runs = 0
        self._lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self.front: EndpointProcess | None = None

    def endpoint(self, handler: Handler) -> Served:
        """The endpoint for one rollout's `handler`, served from the endpoint's process (started here, and
        started anew where a process of the pool has exited)."""
        if self.front is None or not self.front.alive() or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        return self.front.serve(handler)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.front = EndpointProcess()
        for _ in range(self.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child,), name="rlcu-agent-worker", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._listener = threading.Thread(target=self._listen, name="rlcu-agent-workers", daemon=True)
        self._listener.start()

    def run(self, program: Callable, episodes: list[tuple[int, str, dict]], api_key: str, model: str,
            timeout: float | None, ended: Callable[[int, object, BaseException | None], None]) -> _Run:
        """Starts `program` on each (index, base_url, row) of `episodes`, spread over the workers."""
        try:
            payload = pickle.dumps(program)
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds
            raise ValueError(f"agent_processes runs the agent program in worker processes, which get it by pickle, "
                             f"and {getattr(program, '__qualname__', type(program).__name__)} does not pickle ({e}); "
                             "define it at the top level of an importable module, or set agent_processes: 0") \
                from None
        if not self._procs:
            raise RuntimeError("ProgramWorkers.run before endpoint(): the programs' endpoint is served first")
        shares = [episodes[k::self.processes] for k in range(self.processes)]
        with self._lock:
            self._runs += 1
            run = self._run = _Run(self._runs, ended, {k: {e[0] for e in share} for k, share in enumerate(shares)},
                                   {k for k, share in enumerate(shares) if share})
        if not run.pending:
            run.done.set()
        for k, share in enumerate(shares):
            if share:
                try:
                    self._conns[k].send(("run", run.number, payload, share, api_key, model, timeout))
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    self.cancel(run)
                    raise ValueError(f"agent_processes sends each episode's row to a worker process by pickle, and "
                                     f"a row does not pickle ({e}); keep rows to plain data, or set "
                                     "agent_processes: 0") from None
        return run

    def cancel(self, run: _Run) -> None:
        """Cancels the rollout's programs that have not returned."""
        for k in sorted(run.pending):
            try:
                self._conns[k].send(("cancel", run.number))
            except OSError:
                pass

    def finish(self, run: _Run, seconds: float) -> None:
        """Waits up to `seconds` for the workers to finish `run` (their teardown too); a worker that does not is
        stopped, and the workers start anew at the next rollout."""
        if not run.done.wait(seconds):
            self.close()

    def _listen(self) -> None:
        workers = {conn: k for k, conn in enumerate(self._conns)}
        while workers:
            try:
                ready = wait(list(workers))
            except (OSError, ValueError):  # close() closed the pipes
                return
            for conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the worker exited: its unfinished episodes end with an error
                    self._lost(workers.pop(conn))
                    continue
                self._dispatch(workers[conn], message)

    def _dispatch(self, k: int, message: tuple) -> None:
        run = self._run
        if run is None or message[1] != run.number:
            return  # a cancelled rollout's late news
        if message[0] == "ended":
            _, _, index, result, error = message
            run.unfinished[k].discard(index)
            run.ended(index, result, error)
        elif message[0] == "done":
            self._finished(run, k)

    def _lost(self, k: int) -> None:
        run = self._run
        if run is None or k not in run.pending:
            return
        code = None
        if k < len(self._procs):
            self._procs[k].join(5.0)  # its pipe closes as it exits: it is being reaped
            code = self._procs[k].exitcode
        for index in sorted(run.unfinished[k]):
            run.ended(index, None, RuntimeError(f"its agent worker process exited (code {code}) before the program "
                                                "returned"))
        self._finished(run, k)

    def _finished(self, run: _Run, k: int) -> None:
        with self._lock:
            run.pending.discard(k)
            if not run.pending:
                run.done.set()

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        if self._listener is not None:
            self._listener.join(5.0)
        if self.front is not None:
            self.front.close()
        self._conns, self._procs, self._listener, self.front = [], [], None, None


# ---- in a worker -------------------------------------------------------------------------------------
def serve(conn: Connection) -> None:
    """A worker's life: rollouts as the trainer sends them, until it sends None or goes away."""
    from rlcu.agents.endpoint import new_event_loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(conn))
    finally:
        loop.close()


async def _serve(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def readable() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(None)

    watch(loop, conn, readable)
    running: dict[int, asyncio.Task] = {}
    while (message := await inbox.get()) is not None:
        if message[0] == "run":
            number = message[1]
            running[number] = asyncio.ensure_future(_rollout(conn, *message[1:]))
            running[number].add_done_callback(lambda _, n=number: running.pop(n, None))
        elif message[0] == "cancel" and message[1] in running:
            running[message[1]].cancel()
    for task in running.values():
        task.cancel()
    await asyncio.gather(*running.values(), return_exceptions=True)


async def _rollout(conn: Connection, number: int, payload: bytes, share: list, api_key: str, model: str,
                   timeout: float | None) -> None:
    from rlcu.agents.programs import AgentEndpoint, SharedClient

    shared = SharedClient(api_key, asyncio.get_running_loop())
    try:
        program = pickle.loads(payload)
    except Exception as e:  # noqa: BLE001 - a module the trainer's process has and this one cannot import
        error = RuntimeError(f"the agent worker process cannot load the program ({type(e).__name__}: {e}); give "
                             "it by an import path that a fresh Python process can import")
        for index, _, _ in share:
            conn.send(("ended", number, index, None, error))
        conn.send(("done", number))
        return

    async def one(index: int, base_url: str, row: dict) -> None:
        result, error = None, None
        try:
            result = await asyncio.wait_for(program(AgentEndpoint(base_url, api_key, model, shared), row), timeout)
        except BaseException as e:  # noqa: BLE001 - reported by the trainer's record(), naming the episode
            error = e
        conn.send(("ended", number, index, *_portable(result, error)))

    try:
        await asyncio.gather(*(one(*episode) for episode in share))
    except asyncio.CancelledError:
        pass
    finally:
        await shared.close()
        conn.send(("done", number))


def _portable(result, error: BaseException | None) -> tuple:
    """(result, error) as they cross to the trainer: what does not pickle becomes an error that names it."""
    if error is not None:
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an exception that does not pickle is sent as its text
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return None, error
    try:
        pickle.dumps(result)
    except Exception as e:  # noqa: BLE001
        return None, TypeError(f"the program returned a {type(result).__name__}, which does not pickle ({e}); "
                               "return the episode's reward (a number) or None")
    return result, None
