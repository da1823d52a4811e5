"""An OpenAI-compatible HTTP endpoint on localhost, served while a rollout runs, for agents that are programs.

Each episode has its own base URL (`http://127.0.0.1:PORT/episodes/ID/v1`), and every request must carry the run's
random key as its bearer token. The endpoint binds 127.0.0.1 only. It answers a wrong key (401), an unknown
episode (404), a body that is not JSON or lacks what the route needs (400), a body over `max_body_bytes` (413) and
a body that does not arrive within `body_timeout` (408) with OpenAI's error shape, never a crash. It stops with the
rollout within about a second whatever clients still hold (stalled, half-sent), leaving no port open.

The routes are `POST .../chat/completions` (with `tools`, and `stream`: server-sent events), `POST
.../completions` and `GET .../models`. What a request means is the `Handler`'s (`programs.py`): this module is
the HTTP part alone, on aiohttp, in a thread of its own with its own event loop."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
from typing import Any, Protocol

MAX_BODY_BYTES = 1 << 20
NOT_RUNNING = "no episode {!r} is running (it ended, timed out, or never existed)"
BODY_TIMEOUT_S = 30.0
# a stopped endpoint's rollout has ended: what is still open then is a stalled or abandoned client, not an answer
SHUTDOWN_TIMEOUT_S = 1.0


def new_key() -> str:
    return "rlcu-" + secrets.token_urlsafe(24)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (Linux and macOS), asyncio's otherwise. The endpoint's loop and the
    programs' loop run every call of every episode in Python, under the interpreter lock the engine's thread needs
    between its steps; uvloop's transports and scheduling are C, and hold it for less of each call."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _within(awaitable, seconds: float):
    """`awaitable`'s result, TimeoutError after `seconds`: asyncio.timeout where there is one (Python 3.11), which
    runs it in the calling task; wait_for makes a task of it, a cost on every call of a busy endpoint."""
    if not hasattr(asyncio, "timeout"):
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds):
        return await awaitable


class HTTPError(Exception):
    """An error the client gets as OpenAI's `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


class Handler(Protocol):
    model_name: str

    def has_episode(self, episode: str) -> bool: ...

    async def chat(self, episode: str, body: dict) -> dict: ...

    async def completion(self, episode: str, body: dict) -> dict: ...


class Endpoint:
    """`start()` serves `handler` on a free port of 127.0.0.1; `stop()` closes it. Also a context manager."""

    def __init__(self, handler: Handler, max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT_S):
        self.handler, self.max_body_bytes, self.body_timeout = handler, max_body_bytes, body_timeout
        self.api_key: str | None = new_key()  # None: every request gets 401
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def __enter__(self) -> "Endpoint":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        base = "/episodes/{episode}/v1"
        app.router.add_post(base + "/chat/completions", self._chat)
        app.router.add_post(base + "/completions", self._completion)
        app.router.add_get(base + "/models", self._models)
        self.loop = new_event_loop()
        started = threading.Event()

        async def serve():
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(serve())
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="rlcu-endpoint", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the agent endpoint did not start within 30 s")

    def stop(self) -> None:
        if self.loop is None:
            return
        async def shutdown():
            await self._runner.cleanup()
            # what cleanup leaves is a connection stalled mid-request: cancelled here rather than destroyed pending
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
        self.loop = None

    # ---- HTTP ----------------------------------------------------------------------------------------
    def _check(self, request) -> str:
        if self.api_key is None or request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
            raise HTTPError(401, "wrong or missing API key: use the key rlcu gave the agent", "invalid_api_key")
        episode = request.match_info["episode"]
        if not self.handler.has_episode(episode):
            raise HTTPError(404, NOT_RUNNING.format(episode), "episode_not_found")
        return episode

    async def _body(self, request) -> dict:
        try:
            body = await _within(request.json(), self.body_timeout)
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the request body is not JSON ({e})") from None
        except TimeoutError:
            raise HTTPError(408, f"the request body did not arrive within {self.body_timeout:g} s", "timeout") from None
        if not isinstance(body, dict):
            raise HTTPError(400, f"the request body is a JSON {type(body).__name__}, not an object")
        return body

    async def _chat(self, request):
        episode = self._check(request)
        body = await self._body(request)
        out = await self.handler.chat(episode, body)
        return await self._stream(request, out) if body.get("stream") else self._json(out)

    async def _completion(self, request):
        episode = self._check(request)
        body = await self._body(request)
        out = await self.handler.completion(episode, body)
        return await self._stream_text(request, out) if body.get("stream") else self._json(out)

    async def _models(self, request):
        self._check(request)
        return self._json({"object": "list", "data": [{"id": self.handler.model_name, "object": "model",
                                                        "owned_by": "rlcu"}]})

    @staticmethod
    def _json(data: Any, status: int = 200):
        from aiohttp import web

        return web.json_response(data, status=status)

    async def _stream(self, request, out: dict):
        """The whole turn as server-sent events: a role chunk, a content chunk, the tool calls, then [DONE] (the
        turn is sampled before the answer starts)."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        message, choice = out["choices"][0]["message"], out["choices"][0]
        head = {k: out[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        deltas = [{"role": "assistant", "content": ""}, {"content": message.get("content") or ""}]
        if message.get("tool_calls"):
            deltas.append({"tool_calls": [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]})
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunk = head | {"choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"] if i == 1 else None,
                                         "finish_reason": choice["finish_reason"] if last else None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_text(self, request, out: dict):
        """A text completion as server-sent events: its text in one chunk, then [DONE]."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = {k: out[k] for k in ("id", "object", "created", "model", "choices")}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _error(status: int, message: str, code: str):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": code, "code": code}}, status=status)

    @property
    def _errors(self):
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            try:
                return await handler(request)
            except HTTPError as e:
                return self._error(e.status, str(e), e.code)
            except web.HTTPRequestEntityTooLarge:
                return self._error(413, f"the request body is over {self.max_body_bytes} bytes",
                                   "request_too_large")
            except web.HTTPException as e:
                return self._error(e.status, e.reason or "HTTP error", "invalid_request_error")
            except Exception as e:  # noqa: BLE001 - the endpoint answers, whatever a handler did
                return self._error(500, f"{type(e).__name__}: {e}", "server_error")
        return errors


# ---- the HTTP side in a process of its own -----------------------------------------------------------
def watch(loop: asyncio.AbstractEventLoop, conn, callback) -> None:
    """`callback` whenever `conn` (a multiprocessing Connection) has something to read. uvloop makes a watched
    descriptor non-blocking, and a Connection's recv and send assume a blocking one (a message longer than the
    pipe's buffer would end in BlockingIOError): it is made blocking again."""
    loop.add_reader(conn.fileno(), callback)
    os.set_blocking(conn.fileno(), True)




class EndpointProcess:
    """The endpoint's HTTP side in a process of its own (`agent_processes`): an `Endpoint` there parses each
    request and writes each answer, and what a call means is still the handler's, here, one pipe message a call
    each way. In this process the HTTP stack's Python (many event-loop turns a call, each waiting for the
    interpreter lock the engine's thread holds between its steps) becomes one message in and one out.

    It serves one handler at a time (`serve`), rollout after rollout on one port, until `close()`; between
    rollouts every request gets 401."""

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT_S,
                 start_timeout: float = 120.0):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_front, args=(child, max_body_bytes, body_timeout),
                                   name="rlcu-endpoint", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.process.kill()
            raise RuntimeError(f"the agent endpoint's process did not start within {start_timeout:g} s")
        try:
            self.port: int = self._conn.recv()
        except EOFError:
            self.process.join(5.0)
            raise RuntimeError(f"the agent endpoint's process exited as it started (code {self.process.exitcode}); "
                               "a script that sets agent_processes starts processes the spawn way, so it needs its "
                               "training under `if __name__ == \"__main__\":`") from None
        self._send_lock = threading.Lock()
        self.handler: Handler | None = None
        self._tasks: set[asyncio.Task] = set()
        self.loop = new_event_loop()
        watch(self.loop, self._conn, self._readable)
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlcu-endpoint-calls", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self.process.is_alive() and self.loop is not None

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def serve(self, handler: Handler) -> "Served":
        return Served(self, handler)

    def _attach(self, handler: Handler | None, api_key: str | None) -> None:
        self.handler = handler
        try:
            self._send(("key", api_key, handler.model_name if handler is not None else ""))
        except OSError:  # the process has exited: nothing is served, and the next rollout starts it anew
            if handler is not None:
                raise RuntimeError("the agent endpoint's process has exited") from None
        if handler is None:  # the calls still waiting for an answer get 404, as the episode has ended
            asyncio.run_coroutine_threadsafe(self._cancel_calls(), self.loop).result(30)

    async def _cancel_calls(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _readable(self) -> None:
        try:
            while True:  # every call that came, in one turn of the loop: a wave of calls comes at once
                _, number, route, episode, body = self._conn.recv()
                task = self.loop.create_task(self._call(number, route, episode, body))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                if not self._conn.poll():
                    return
        except (EOFError, OSError):  # the process exited: what it served is gone with it
            self.loop.remove_reader(self._conn.fileno())

    async def _call(self, number: int, route: str, episode: str, body: dict) -> None:
        handler = self.handler
        try:
            if handler is None or not handler.has_episode(episode):
                raise HTTPError(404, NOT_RUNNING.format(episode), "episode_not_found")
            out = await (handler.chat if route == "chat" else handler.completion)(episode, body)
            reply = (200, out)
        except HTTPError as e:
            reply = (e.status, (str(e), e.code))
        except asyncio.CancelledError:  # the rollout ended before the answer
            reply = (404, (NOT_RUNNING.format(episode), "episode_not_found"))
        except Exception as e:  # noqa: BLE001 - the endpoint answers, whatever a handler did
            reply = (500, (f"{type(e).__name__}: {e}", "server_error"))
        try:
            self._send(("reply", number, *reply))
        except OSError:
            pass

    def close(self) -> None:
        if self.loop is None:
            return
        try:
            self._send(None)
        except OSError:
            pass
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.remove_reader(self._conn.fileno())
        self.loop.close()
        self._conn.close()
        self.loop = None


class Served:
    """An `EndpointProcess` serving one rollout's handler: what `Endpoint` offers a rollout (`base_url`,
    `api_key`, `start`, `stop`, `loop` while it serves), on the process's port."""

    def __init__(self, front: EndpointProcess, handler: Handler):
        self.front, self.handler, self.api_key, self.port = front, handler, new_key(), front.port
        self.loop: asyncio.AbstractEventLoop | None = None

    def base_url(self, episode: str) -> str:
        return self.front.base_url(episode)

    def start(self) -> None:
        self.front._attach(self.handler, self.api_key)
        self.loop = self.front.loop

    def stop(self) -> None:
        if self.loop is not None and self.front.loop is not None:
            self.front._attach(None, None)
        self.loop = None

    def __enter__(self) -> "Served":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Proxy:
    """In the endpoint's process: the handler, whose calls go to the trainer's process and whose answers come
    back on the same pipe."""

    def __init__(self, conn, endpoint: Endpoint, stopped: threading.Event):
        self.conn, self.endpoint, self.stopped = conn, endpoint, stopped
        self.model_name = ""
        self.pending: dict[int, asyncio.Future] = {}
        self.calls = 0

    def has_episode(self, episode: str) -> bool:
        return True  # the trainer's process answers 404 for an episode it does not run

    async def chat(self, episode: str, body: dict) -> dict:
        return await self._ask("chat", episode, body)

    async def completion(self, episode: str, body: dict) -> dict:
        return await self._ask("completion", episode, body)

    async def _ask(self, route: str, episode: str, body: dict) -> dict:
        self.calls += 1
        number, answer = self.calls, asyncio.get_running_loop().create_future()
        self.pending[number] = answer
        try:
            self.conn.send(("call", number, route, episode, body))
            status, out = await answer
        finally:
            self.pending.pop(number, None)
        if status != 200:
            raise HTTPError(status, *out)
        return out

    def readable(self) -> None:
        while True:  # every answer that came, in one turn of the loop
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None:  # close(), or the trainer's process is gone
                self.endpoint.loop.remove_reader(self.conn.fileno())
                self.stopped.set()
                return
            if message[0] == "key":
                self.endpoint.api_key, self.model_name = message[1], message[2]
            elif message[0] == "reply" and message[1] in self.pending:
                self.pending[message[1]].set_result((message[2], message[3]))
            if not self.conn.poll():
                return


def _front(conn, max_body_bytes: int, body_timeout: float) -> None:
    """The endpoint's process: an `Endpoint` on a free port whose handler is the trainer's, through `conn`."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops this process
    stopped = threading.Event()
    endpoint = Endpoint(None, max_body_bytes, body_timeout)
    endpoint.api_key = None
    endpoint.handler = proxy = _Proxy(conn, endpoint, stopped)
    endpoint.start()
    endpoint.loop.call_soon_threadsafe(watch, endpoint.loop, conn, proxy.readable)
    conn.send(endpoint.port)
    stopped.wait()
    endpoint.stop()
