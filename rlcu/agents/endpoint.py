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
import secrets
import threading
from typing import Any, Protocol

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0
# a stopped endpoint's rollout has ended: what is still open then is a stalled or abandoned client, not an answer
SHUTDOWN_TIMEOUT_S = 1.0


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
        self.api_key = "rlcu-" + secrets.token_urlsafe(24)
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
        if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
            raise HTTPError(401, "wrong or missing API key: use the key rlcu gave the agent", "invalid_api_key")
        episode = request.match_info["episode"]
        if not self.handler.has_episode(episode):
            raise HTTPError(404, f"no episode {episode!r} is running (it ended, timed out, or never existed)",
                            "episode_not_found")
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
