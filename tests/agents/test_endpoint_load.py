"""The agent endpoint under hostile traffic on 127.0.0.1, during a real rollout: 1,000 connections at once, clients
that send half a request and stall, a client that disconnects before its streamed answer. Each gets an HTTP error
or a closed connection, memory stays bounded, the rollout's samples are those of a quiet run, and no port is left
listening after it."""
import asyncio
import json
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import pytest

from rlcu.agents.endpoint import Endpoint
from rlcu.agents.formats import tool_format
from rlcu.agents.programs import ProgramRunner
from rlcu.contracts import SamplingParams
from rlcu.engine.llm_engine import EngineConfig, LLMEngine
from rlcu.models import load_model
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

pytest.importorskip("aiohttp")
CONNECTIONS = 1000


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _request(path: str, body: bytes, key: str | None, length: int | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def _status(sock: socket.socket) -> int:
    sock.settimeout(30)
    head = sock.recv(64)
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else -1


def _flood(port: int, episode_path: str, key: str) -> dict:
    """CONNECTIONS connections opened at once, then each sends a request (a wrong key, or an unknown episode) and
    reads its status; memory is read with all of them open."""
    good = json.dumps({"messages": [{"role": "user", "content": "t1"}]}).encode()
    before = _rss_mb()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(CONNECTIONS)]
    for i, s in enumerate(socks):
        wrong = i % 2 == 0
        path = episode_path if wrong else episode_path.replace("/episodes/", "/episodes/nope")
        s.sendall(_request(path + "/chat/completions", good, "rlcu-wrong" if wrong else key))
    statuses = [_status(s) for s in socks]
    grown = _rss_mb() - before
    for s in socks:
        s.close()
    return {"statuses": sorted(set(statuses)), "counts": {c: statuses.count(c) for c in set(statuses)},
            "rss_growth_mb": grown}


def _stalled(port: int, episode_path: str, key: str) -> list[socket.socket]:
    """Two clients that stop half-way: one in its headers, one in its body."""
    head = socket.create_connection(("127.0.0.1", port))
    head.sendall(b"POST " + episode_path.encode() + b"/chat/comp")
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(_request(episode_path + "/chat/completions", b'{"messages": [', key, length=400))
    return [head, body]


def _disconnects(port: int, episode_path: str, key: str, messages: list, registered: threading.Event) -> None:
    """The episode's first call, streamed, from a client that hangs up once the endpoint took it, before its
    answer."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request(episode_path + "/chat/completions", json.dumps({"messages": messages, "stream": True}).encode(),
                       key))
    assert registered.wait(30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a killed client's
    s.close()


def _rollout(model, tok, hostile: bool, registered: threading.Event):
    seen, stalled, hostile_ended = {}, [], asyncio.Event()

    async def program(endpoint, row):
        loop = asyncio.get_running_loop()
        messages = [{"role": "user", "content": row["prompt"]}]
        url = urlsplit(endpoint.base_url)
        port, path = url.port, url.path
        if row["hostile"] and hostile:
            seen.update(await loop.run_in_executor(None, _flood, port, path, endpoint.api_key))
            stalled.extend(await loop.run_in_executor(None, _stalled, port, path, endpoint.api_key))
            await loop.run_in_executor(None, _disconnects, port, path, endpoint.api_key, messages, registered)
            hostile_ended.set()  # the program ends with its call unanswered, before the rollout starts
            return 0.5
        if hostile:
            await hostile_ended.wait()
        client = endpoint.client()
        first = await client.chat.completions.create(model=endpoint.model, messages=messages)
        if row["hostile"]:  # the quiet twin: the same single call, answered
            return 0.5
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "t7"}]
        await client.chat.completions.create(model=endpoint.model, messages=messages)
        return 1.0

    rows = [{"prompt": "t3 t4", "hostile": True}, {"prompt": "t9", "hostile": False}]
    runner = ProgramRunner(rows, program, tool_format("template", tok), "policy", 40, 60.0)
    port = runner.endpoint.port
    try:
        start = time.monotonic()
        sp = SamplingParams(max_tokens=40, max_turn_tokens=5, temperature=1.0, seed=0)
        out = LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(runner.prompt_ids, sp, continuation=runner)
        episodes = runner.record()
        elapsed = time.monotonic() - start
    finally:
        start = time.monotonic()
        runner.close()
        closing = time.monotonic() - start
    return out, episodes, seen, stalled, port, elapsed, closing


def test_hostile_traffic_gets_errors_while_the_rollout_and_its_samples_go_on(tmp_path, monkeypatch):
    model, tok = load_model(tiny_hf_folder(tmp_path, "qwen3", chat_template=CHAT_TEMPLATE))
    registered, chat = threading.Event(), ProgramRunner.chat

    async def chat_then_signal(self, episode, body):
        call = asyncio.ensure_future(chat(self, episode, body))
        await asyncio.sleep(0)  # the call's first step registers it with its episode
        registered.set()
        return await call

    monkeypatch.setattr(ProgramRunner, "chat", chat_then_signal)
    quiet, quiet_episodes, *_ = _rollout(model, tok, False, registered)
    registered.clear()
    out, episodes, seen, stalled, port, elapsed, closing = _rollout(model, tok, True, registered)

    assert seen["counts"] == {401: CONNECTIONS // 2, 404: CONNECTIONS // 2}
    assert seen["rss_growth_mb"] < 100, seen  # both ends of 1,000 connections live in this process
    assert elapsed < 30  # the abandoned call did not hold its episode until the 60 s timeout
    assert closing < 5  # the stalled clients do not hold the endpoint's shutdown
    for s in stalled:  # they were closed by the server, with no answer
        s.settimeout(5)
        assert s.recv(4096) == b""
        s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    # the samples are the quiet run's, token for token: the hostile episode's one turn, the other's two
    assert out.completion_ids == quiet.completion_ids
    assert episodes.columns["agent_returns"] == quiet_episodes.columns["agent_returns"] == [0.5, 1.0]
    assert episodes.completions == quiet_episodes.completions


class _Slow:
    model_name = "policy"

    def has_episode(self, episode):
        return episode == "e"

    async def chat(self, episode, body):
        return {}

    async def completion(self, episode, body):
        return {}


def test_a_body_that_stalls_gets_408_within_the_body_timeout():
    with Endpoint(_Slow(), body_timeout=0.5) as endpoint:
        s = socket.create_connection(("127.0.0.1", endpoint.port))
        s.sendall(_request("/episodes/e/v1/chat/completions", b'{"messages": [', endpoint.api_key, length=400))
        start = time.monotonic()
        assert _status(s) == 408
        assert time.monotonic() - start < 5
        s.close()
