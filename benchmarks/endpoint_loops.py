"""The agent endpoint's own cost per call, without the engine: 64 agent programs of 4 /v1/completions calls each (as
`rlcu bench rollout --turns 4 --http` runs them) against rlcu's `Endpoint` with a handler that answers at once, while
a thread spins in Python as the engine's does between its steps. The programs run on a thread of this process (on
asyncio's event loops, then on uvloop's), then in worker processes with the endpoint's HTTP side in a process of
its own (`agent_processes`, on uvloop).

    python3 benchmarks/endpoint_loops.py [--episodes 64] [--turns 4] [--repeats 5] [--processes 1]
"""
import argparse
import asyncio
import statistics
import threading
import time

import aiohttp
import torch

from rlcu.agents import endpoint as endpoint_module
from rlcu.agents.programs import AgentEndpoint
from rlcu.agents.workers import ProgramWorkers


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


class Agent:
    """`turns` calls of one episode, each prompt the last one and its answer's token ids (a class: it pickles)."""

    def __init__(self, turns: int, prompt: int, tokens: int):
        self.turns, self.prompt, self.tokens = turns, prompt, tokens

    async def __call__(self, endpoint, row) -> None:
        ids = list(range(self.prompt))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {endpoint.api_key}"}) as session:
            for _ in range(self.turns):
                body = {"model": "bench", "prompt": ids, "max_tokens": self.tokens}
                async with session.post(endpoint.base_url + "/completions", json=body) as response:
                    out = await response.json()
                ids += out["choices"][0]["token_ids"]


async def wave(endpoint, args) -> None:
    agent = Agent(args.turns, args.prompt, args.tokens)
    await asyncio.gather(*[agent(AgentEndpoint(endpoint.base_url(f"e{i}"), endpoint.api_key, "bench"), {})
                           for i in range(args.episodes)])


def in_workers(workers: ProgramWorkers, endpoint, args) -> None:
    episodes = [(i, endpoint.base_url(f"e{i}"), {}) for i in range(args.episodes)]
    run = workers.run(Agent(args.turns, args.prompt, args.tokens), episodes, endpoint.api_key, "bench", None,
                      lambda index, result, error: None)
    if not run.done.wait(600):
        raise TimeoutError("the worker processes did not finish a wave within 600 s")


def timed(loop_kind: str, args) -> list[float]:
    make = asyncio.new_event_loop if loop_kind == "asyncio" else endpoint_module.new_event_loop
    endpoint_module.new_event_loop, original = make, endpoint_module.new_event_loop  # the endpoint's loop
    stop, steps = threading.Event(), [0]

    def engine():  # the engine's thread: Python between short operations that let go of the interpreter lock
        a = torch.ones(8, 8)
        while not stop.is_set():
            if args.engine == "spin":
                sum(range(1000))
            else:
                for _ in range(20):
                    a = torch.add(a, 1.0)
            steps[0] += 1

    spinner = threading.Thread(target=engine, daemon=True)
    spinner.start()
    time.sleep(0.2)
    alone = steps[0]
    time.sleep(1.0)
    alone = steps[0] - alone  # the engine's steps a second with nothing beside it
    busy = []
    loop = make()  # the programs' loop
    workers = ProgramWorkers(args.processes) if loop_kind == "workers" else None
    try:
        with (endpoint_module.Endpoint(Instant(args.tokens)) if workers is None
              else workers.endpoint(Instant(args.tokens))) as endpoint:
            times = []
            for _ in range(args.repeats):
                start, before = time.perf_counter(), steps[0]
                if workers is None:
                    loop.run_until_complete(wave(endpoint, args))
                else:
                    in_workers(workers, endpoint, args)
                times.append(time.perf_counter() - start)
                busy.append((steps[0] - before) / times[-1] / alone)
    finally:
        stop.set()
        spinner.join()
        loop.close()
        if workers is not None:
            workers.close()
        endpoint_module.new_event_loop = original
    return times, busy


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128, help="token ids of each episode's first prompt")
    p.add_argument("--tokens", type=int, default=128, help="token ids each call returns")
    p.add_argument("--repeats", type=int, default=5, help="waves on each arm; the first (a warm-up) is not counted")
    p.add_argument("--processes", type=int, default=1, help="worker processes of the last arm")
    p.add_argument("--engine", choices=("ops", "spin"), default="ops",
                   help="the engine's thread: short torch operations, each letting go of the interpreter lock, as "
                        "its steps' Python does (ops); or pure Python that keeps it for the switch interval (spin)")
    args = p.parse_args()
    import uvloop  # noqa: F401  (both arms, or the second would be asyncio's again)

    calls = args.episodes * args.turns
    for kind in ("asyncio", "uvloop", "workers", "asyncio", "uvloop", "workers"):
        times, busy = timed(kind, args)
        best, median = min(times[1:]), statistics.median(times[1:])
        name = (f"{args.processes} worker process(es) and the endpoint's process, uvloop" if kind == "workers"
                else f"a thread, {kind}")
        print(f"programs on {name}: {calls} calls, best {best * 1e3:.0f} ms, median {median * 1e3:.0f} ms "
              f"({median / calls * 1e3:.2f} ms a call); runs {[round(t * 1e3) for t in times]}; the engine's "
              f"steps meanwhile {statistics.median(busy[1:]):.0%} of its rate alone", flush=True)


if __name__ == "__main__":
    main()
