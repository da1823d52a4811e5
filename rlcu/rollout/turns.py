"""Episodes on a backend that only generates single turns: each turn is a new request holding the whole
history so far, prefilled again. The native engine keeps each episode's KV in its pool instead (see
`engine/llm_engine.py`); both follow the same `Turn` / `Reply` protocol, so a continuation (tools,
environments) runs unchanged on either, and greedy episodes agree token for token."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from rlcu.contracts import (
    Continuation,
    RolloutBatch,
    SamplingParams,
    Turn,
    check_reply,
    continuation_spawns,
    continuation_workers,
    reply_of,
    turn_bound,
)
from rlcu.rollout.base import capabilities_of

TURN_SEED_STRIDE = 1_000_003  # each turn draws from its own seed


def generate(backend, prompt_token_ids: list[list[int]], sampling: SamplingParams,
             continuation: Continuation | None = None, on_finished: Callable[[Turn], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> RolloutBatch:
    """The one way the module asks a backend for a rollout, by its declared capabilities: episodes run in the
    backend when it can (`continuation`), else turn by turn here; `on_finished` reaches a backend that reports
    completions as they end, and is left out for one that does not (the caller scores after the rollout);
    `should_stop` reaches a backend that stops between decode steps when asked (`interruptible`)."""
    caps = capabilities_of(backend)
    asked = {"should_stop": should_stop} if should_stop is not None and caps.interruptible else {}
    if continuation_spawns(continuation) is not None and not (caps.continuation and caps.spawns):
        raise ValueError(f"{type(continuation).__name__} adds requests while the rollout runs (spawns: an agent "
                         f"program's branches), which {type(backend).__name__} does not take: use rollout: native, "
                         "or set max_branches=0")
    if continuation is not None:
        if caps.continuation:
            return backend.generate(prompt_token_ids, sampling, continuation=continuation, **asked)
        return generate_in_turns(partial(backend.generate, **asked), prompt_token_ids, sampling, continuation)
    if on_finished is not None and caps.on_finished:
        asked["on_finished"] = on_finished
    return backend.generate(prompt_token_ids, sampling, **asked)


def generate_in_turns(generate, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                      continuation: Continuation, workers: int = 16) -> RolloutBatch:
    """`generate(prompt_token_ids, sampling) -> RolloutBatch` called once per turn (and per remaining budget)."""
    n = len(prompt_token_ids)
    completions: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    masks: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    own = list(sampling.first_turn_tokens or [None] * n)  # each episode's bound on its next turn
    if len(own) != n:
        raise ValueError(f"first_turn_tokens has {len(own)} entries for {n} prompts")
    active, turn = list(range(n)), 0
    with ThreadPoolExecutor(continuation_workers(continuation, workers), thread_name_prefix="rlcu-turn") as pool:
        while active:
            ended = _one_turn(generate, prompt_token_ids, sampling, turn, active, completions, logprobs, masks, own)
            replies = list(pool.map(partial(reply_of, continuation),
                                    [Turn(i, list(completions[i]), reason, list(logprobs[i])) for i, reason in ended]))
            active = []
            for (i, reason), reply in zip(ended, replies):
                check_reply(reply, len(completions[i]), sampling.max_tokens)
                if reply.token_ids is None:
                    reasons[i] = reply.finish_reason or reason
                    continue
                completions[i] += reply.token_ids
                own[i] = reply.max_turn_tokens
                logprobs[i] += [0.0] * len(reply.token_ids)
                masks[i] += [0] * len(reply.token_ids)
                active.append(i)
            turn += 1
    return RolloutBatch([list(p) for p in prompt_token_ids], completions, logprobs, reasons, tool_mask=masks)


def _one_turn(generate, prompts, sampling, turn, active, completions, logprobs, masks, own) -> list[tuple[int, str]]:
    """Sample the next turn of each active episode; requests are grouped by the tokens they may still take."""
    budgets: dict[int, list[int]] = {}
    for i in active:
        left = sampling.max_tokens - len(completions[i])
        budgets.setdefault(min(left, turn_bound(sampling.max_turn_tokens, own[i]) or left), []).append(i)
    ended = []
    seed = None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE
    for budget, rows in budgets.items():
        out = generate([prompts[i] + completions[i] for i in rows],
                       replace(sampling, max_tokens=budget, max_turn_tokens=None, first_turn_tokens=None, seed=seed))
        for i, ids, lps, reason in zip(rows, out.completion_ids, out.logprobs, out.finish_reasons):
            completions[i] += ids
            logprobs[i] += lps
            masks[i] += [1] * len(ids)
            ended.append((i, reason))
    return ended
