"""The agent endpoint's own cost per call, without the engine: 64 agent programs of 4 /v1/completions calls each (as
`rlcu bench rollout --turns 4 --http` runs them) against rlcu's `Endpoint` with a handler that answers at once, while
a thread spins in Python as the engine's does between its steps. Once on asyncio's event loops, once on uvloop's.

    python3 benchmarks/endpoint_loops.py [--episodes 64] [--turns 4] [--repeats 5]
"""
import argparse
import asyncio
import statistics
import threading
import time

import aiohttp

from rlcu.agents import endpoint as endpoint_module


class Instant:
    """A handler that answers every call with `tokens` token ids at once."""

    model_name = "bench"

    def __init__(self, tokens: int):
        self.reply = {"object": "text_completion", "model": "bench",
                      "choices": [{"index": 0, "text": "x" * tokens, "token_ids": list(range(tokens)),
                                   "finish_reason": "length", "logprobs": None}],
                      "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}}

    def has_episode(self, episode: str) -> bool:
        return True

    async def chat(self, episode: str, body: dict) -> dict:
        raise NotImplementedError

    async def completion(self, episode: str, body: dict) -> dict:
        return self.reply


async def agent(endpoint, episode: str, turns: int, prompt: int, tokens: int) -> None:
    ids = list(range(prompt))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {endpoint.api_key}"}) as session:
        for _ in range(turns):
            body = {"model": "bench", "prompt": ids, "max_tokens": tokens}
            async with session.post(endpoint.base_url(episode) + "/completions", json=body) as response:
                out = await response.json()
            ids += out["choices"][0]["token_ids"]


async def wave(endpoint, args) -> None:
    await asyncio.gather(*[agent(endpoint, f"e{i}", args.turns, args.prompt, args.tokens)
                           for i in range(args.episodes)])


def timed(loop_kind: str, args) -> list[float]:
    make = endpoint_module.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    endpoint_module.new_event_loop, original = make, endpoint_module.new_event_loop  # the endpoint's loop
    stop = threading.Event()

    def engine():  # Python between the engine's steps, competing for the interpreter lock
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=engine, daemon=True)
    spinner.start()
    loop = make()  # the programs' loop
    try:
        with endpoint_module.Endpoint(Instant(args.tokens)) as endpoint:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                loop.run_until_complete(wave(endpoint, args))
                times.append(time.perf_counter() - start)
    finally:
        stop.set()
        spinner.join()
        loop.close()
        endpoint_module.new_event_loop = original
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128, help="token ids of each episode's first prompt")
    p.add_argument("--tokens", type=int, default=128, help="token ids each call returns")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import uvloop  # noqa: F401  (both arms, or the second would be asyncio's again)

    calls = args.episodes * args.turns
    for kind in ("asyncio", "uvloop", "asyncio", "uvloop"):
        times = timed(kind, args)
        best, median = min(times[1:]), statistics.median(times[1:])
        print(f"{kind}: {calls} calls, best {best * 1e3:.0f} ms, median {median * 1e3:.0f} ms "
              f"({median / calls * 1e3:.2f} ms a call); runs {[round(t * 1e3) for t in times]}", flush=True)


if __name__ == "__main__":
    main()
