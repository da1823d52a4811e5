"""Agents that are programs: an async function `agent(endpoint, row)` that talks to the policy through an
OpenAI-compatible endpoint (`endpoint.py`) and returns the episode's reward (a number), or None to leave scoring to
the run's rewards, which then get the episode's messages as TRL's rewards get an agent's.

    async def agent(endpoint, row):
        client = endpoint.client()                         # openai.AsyncOpenAI on this episode's base URL
        reply = await client.chat.completions.create(model=endpoint.model, messages=[...])
        ...
        return 1.0 if solved else 0.0

One episode is one training sample: its first call's messages are the prompt; each later call must extend the
conversation so far (the messages sent before, the assistant message as served, then new messages), and only the
new messages' tokens are added, rendered by the chat template after the served tokens. The tokens sampled for the
agent are recorded as sampled (token in, token out: never re-tokenized from text); the appended ones are masked out
of the loss. Sampling settings are the run's (temperature, top_p, max_completion_length over the whole episode); a
request's own are ignored, so that the samples are the policy's.

A call that extends none of its episode's conversations (a sub-agent, a retry on an edited history, a second
sample of the same messages) branches: with `max_branches` above 0 it starts a conversation of its own, which later
calls extend as they extend the first, and which becomes one more training sample of the episode's group. The rule
(docs/agents.md): a group's advantages are computed over its episodes, as without branches, and every branch takes
its episode's advantage: the program's one outcome credits each of its calls, and an episode that branches more
weighs no more in its group's statistics. With `max_branches` 0 such a call gets HTTP 409.

An episode may instead be text: its calls go to `/completions` with a `prompt`, a string or token ids, as vLLM
serves them (the first prompt tokenized with the tokenizer's special tokens; `max_tokens` 16 unless given, OpenAI's
default). Each later prompt must extend the text so far (the prompts sent, the completions as served), as a string
or as token ids; only what it adds is tokenized and appended, masked out of the loss. The rewards then get the
episode's text after its first prompt, as TRL's rewards get a completion of a standard (not conversational) prompt.
A text episode needs no chat template.

`ProgramRunner` is a continuation of the rollout (as `episodes.EpisodeRunner` is for tools): the engine keeps each
episode's KV blocks between its calls."""
from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import abc
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlcu import plugins
from rlcu.agents.endpoint import Endpoint, HTTPError, new_event_loop
from rlcu.agents.episodes import Episodes
from rlcu.agents.formats import ToolFormat
from rlcu.agents.workers import ProgramWorkers
from rlcu.contracts import Reply, RolloutEnded, Spawns, Turn


def _openai():
    try:
        import openai
    except ImportError:
        raise ImportError("endpoint.client() needs the openai package: pip install openai (or use "
                          "endpoint.base_url and endpoint.api_key with any OpenAI-compatible client)") from None
    return openai


class SharedClient:
    """One `openai.AsyncOpenAI` for a rollout's programs, made on their event loop when the first asks: each
    episode's client is a copy on its own base URL that shares its connections: a client made anew costs tens of
    milliseconds of the interpreter (its HTTP client and TLS context), beside the engine, on every episode."""

    def __init__(self, api_key: str, loop: asyncio.AbstractEventLoop):
        self.api_key, self.loop, self.base = api_key, loop, None

    def client(self, base_url: str):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:  # a program's own thread or loop: connections cannot cross event loops
            return _openai().AsyncOpenAI(base_url=base_url, api_key=self.api_key, max_retries=0)
        if self.base is None:
            self.base = _openai().AsyncOpenAI(base_url=base_url, api_key=self.api_key, max_retries=0)
        return self.base.with_options(base_url=base_url)

    async def close(self) -> None:
        if self.base is not None:
            await self.base.close()


@dataclass
class AgentEndpoint:
    """What an agent program is handed: its episode's base URL, the run's key and the model name to ask for."""
    base_url: str
    api_key: str
    model: str
    shared: SharedClient | None = field(default=None, repr=False, compare=False)

    def client(self):
        """An `openai.AsyncOpenAI` client on this episode (needs the `openai` package)."""
        if self.shared is not None:
            return self.shared.client(self.base_url)
        return _openai().AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0)


class AgentProgram(NamedTuple):
    """A run's agent program as the module keeps it: the callable, the chat format its endpoint serves (None: text
    episodes only) and the worker processes it runs in (0: a thread of the trainer's process)."""
    program: Callable
    format: ToolFormat | None
    processes: int


def load_program(spec: str | dict | Callable) -> Callable:
    """An agent program given as a callable, an import path ('my_pkg.agents:solve'), or a class to build, as
    LightningCLI writes one: {'class_path': 'rlcu.agents.verifiers.VerifiersEnvironment', 'init_args': {...}}."""
    if callable(spec):
        return spec
    if isinstance(spec, dict):
        return _build(spec)
    if ":" not in str(spec):
        raise ValueError(f"agent {spec!r}: give an import path 'package.module:function' or a callable")
    fn = _imported(str(spec), f"agent {spec!r}")
    if not callable(fn):
        raise ValueError(f"agent {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _build(spec: dict) -> Callable:
    path, args = spec.get("class_path"), spec.get("init_args") or {}
    if "." not in str(path) or set(spec) - {"class_path", "init_args"} or not isinstance(args, dict):
        raise ValueError(f"agent {spec!r}: give {{'class_path': 'package.module.Class', 'init_args': {{...}}}}")
    program = _imported(str(path), f"agent class {path!r}")(**args)
    if not callable(program):
        raise ValueError(f"agent class {path!r} builds a {type(program).__name__}, which is not callable as "
                         "(endpoint, row)")
    return program


def _imported(path: str, what: str):
    try:
        return plugins.import_path(path)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} cannot be imported ({e}); check the path and that the package is installed") \
            from None


@dataclass
class ProgramEpisode:
    """One conversation of an episode: its first, or a branch (`root` is then the first)."""
    id: str
    row: dict
    messages: list[dict] = field(default_factory=list)
    num_prompt_messages: int = 0
    tools: list[dict] | None = None
    prompt_ids: list[int] | None = None
    consumed: int = 0  # completion tokens already served or appended
    calls: int = 0
    wants_logprobs: bool = False  # the unanswered call asked for `logprobs`
    first_limit: int | None = None  # the first call's own max_tokens
    started: Future = field(default_factory=Future)  # the first call arrived (True), or the program ended (False)
    answer: Future | None = None  # the unanswered call's response
    waiting: Future | None = None  # the next call's (tokens, messages), or None when the program ended
    open: bool = True
    text_mode: bool = False  # its calls go to /completions
    text: str | list[int] = ""  # a text episode: its prompts and completions so far (a string, or token ids)
    first_text: int = 0  # where the first prompt ends in `text`
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)  # the program returned (a branch shares its root's)
    root: ProgramEpisode | None = None  # a branch's episode: its first conversation
    root_index: int = 0  # the episode's row in the rollout
    branches: list[ProgramEpisode] = field(default_factory=list)  # a first conversation's branches, in order


TEARDOWN_S = 10.0  # what close() waits for the programs' teardown once every program returned


class ProgramRunner:
    """Runs one agent program per row (rows already repeated per generation) against an endpoint, for one
    rollout: `prompt_ids` once every program made its first call, then the continuation (`__call__`), then
    `record()` once the programs returned. `close()` stops the endpoint and the programs."""

    def __init__(self, rows: list[dict], program: Callable, fmt: ToolFormat | None, model_name: str,
                 max_completion_length: int, timeout: float | None, tokenizer=None, history: str = "exact",
                 max_branches: int = 0, max_prompt_length: int = 512, workers: ProgramWorkers | None = None):
        """`fmt`: the chat format, or None where the tokenizer has no chat template (text episodes only).
        `workers`: worker processes to run the programs in (`agent_processes`); None runs them on a thread here.
        `history`: agent_history, what a later call's earlier assistant messages must be (`_extension`).
        `max_branches`: conversations an episode may start besides its first (0: a call that branches gets HTTP
        409), each one more request of the rollout (`spawns`, for a backend with the `spawns` capability) whose
        prompt may hold `max_prompt_length` tokens and a whole episode's completion."""
        if history not in HISTORIES:
            raise ValueError(f"agent_history must be one of {HISTORIES}, got {history!r}")
        if max_branches < 0:
            raise ValueError(f"max_branches must be >= 0, got {max_branches}")
        self.program, self.format, self.model_name, self.history = program, fmt, model_name, history
        if tokenizer is None and fmt is None:
            raise ValueError("agent programs need the model's tokenizer: give ProgramRunner a tokenizer or a chat "
                             "format (the model folder has neither)")
        self.tokenizer = tokenizer if tokenizer is not None else fmt.tokenizer
        self.max_completion_length, self.timeout, self.max_branches = max_completion_length, timeout, max_branches
        self.episodes = [ProgramEpisode(secrets.token_hex(8), row, root_index=i) for i, row in enumerate(rows)]
        self.num_episodes = len(rows)
        self.by_id = {e.id: e for e in self.episodes}
        self.spawns = (Spawns(len(rows), len(rows) * max_branches, max_prompt_length + max_completion_length)
                       if max_branches else None)
        # where turns run in threads (rollout/turns.py), each ended one waits in its thread for the program's next
        # call: every conversation may wait at once
        self.waiting_turns = len(self.episodes) * (1 + max_branches)
        # reentrant: a call resolves its turn's reply (`_next_turn`) while it holds the lock
        self.lock = threading.RLock()
        self.endpoint = Endpoint(self) if workers is None else workers.endpoint(self)
        self.endpoint.start()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._workers, self._run, self._loop, self._thread = workers, None, None, None
        try:
            self._start_programs()
            roots = self.episodes[:self.num_episodes]
            self.prompt_ids = [self._first_call(e, i) for i, e in enumerate(roots)]
            self.first_turn_tokens = [e.first_limit for e in roots]
        except BaseException:
            self.close()
            raise

    # ---- the programs --------------------------------------------------------------------------------
    def _start_programs(self) -> None:
        if self._workers is not None:
            roots = self.episodes[:self.num_episodes]
            self._run = self._workers.run(self.program, [(i, self.endpoint.base_url(e.id), e.row)
                                                         for i, e in enumerate(roots)],
                                          self.endpoint.api_key, self.model_name, self.timeout, self._returned)
            return
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run_programs, name="rlcu-agents", daemon=True)
        self._thread.start()

    def _returned(self, index: int, result: Any, error: BaseException | None) -> None:
        """A worker process's program returned (or raised) in episode `index`."""
        ep = self.episodes[index]
        ep.result, ep.error = result, error
        self._ended(ep)

    def _run_programs(self) -> None:
        asyncio.set_event_loop(self._loop)
        shared = SharedClient(self.endpoint.api_key, self._loop)

        async def one(ep: ProgramEpisode):
            endpoint = AgentEndpoint(self.endpoint.base_url(ep.id), self.endpoint.api_key, self.model_name, shared)
            try:
                ep.result = await asyncio.wait_for(self.program(endpoint, ep.row), self.timeout)
            except BaseException as e:  # noqa: BLE001 - reported by record(), naming the episode
                ep.error = e
            finally:
                self._ended(ep)

        async def all_programs():
            try:
                await asyncio.gather(*(one(e) for e in self.episodes[:self.num_episodes]))
            finally:
                await shared.close()

        try:
            self._loop.run_until_complete(all_programs())
        except asyncio.CancelledError:  # close() cancelled the programs that had not returned
            pass

    def _ended(self, ep: ProgramEpisode) -> None:
        """The episode's program returned: none of its conversations takes another call."""
        with self.lock:
            if not ep.started.done():
                ep.started.set_result(False)
            for conversation in (ep, *ep.branches):
                conversation.open = False
                if conversation.waiting is not None and not conversation.waiting.done():
                    conversation.waiting.set_result(None)
            ep.done.set()  # under the lock: a turn answered after this sees it and waits for no next call

    def _first_call(self, ep: ProgramEpisode, index: int) -> list[int]:
        remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        try:
            called = ep.started.result(remaining)
        except TimeoutError:
            raise TimeoutError(f"agent program {_name(self.program)}: episode {index} made no call within its "
                               f"timeout of {self.timeout} s") from None
        if not called:
            what = f"raised {type(ep.error).__name__}: {ep.error}" if ep.error is not None else "returned"
            raise RuntimeError(f"agent program {_name(self.program)} {what} before its first call in episode "
                               f"{index} (row {_brief(ep.row)}); an episode needs at least one call")
        return ep.prompt_ids

    # ---- the endpoint's handler ----------------------------------------------------------------------
    def has_episode(self, episode: str) -> bool:
        ep = self.by_id.get(episode)
        return ep is not None and (ep.open or bool(self.max_branches) and not ep.done.is_set())

    async def completion(self, episode: str, body: dict) -> dict:
        prompt, wants_logprobs = _prompt(body, len(self.tokenizer)), _text_logprobs_asked(body)
        limit = _max_tokens(body) or DEFAULT_TEXT_TOKENS
        root = self.by_id[episode]
        with self.lock:
            if not self.has_episode(episode):
                raise HTTPError(404, f"episode {episode!r} has ended", "episode_not_found")
            if root.prompt_ids is None:
                root.prompt_ids = list(prompt) if isinstance(prompt, list) else list(self.tokenizer(prompt).input_ids)
                root.text_mode, root.text, root.first_text, root.first_limit = True, prompt, len(prompt), limit
                root.answer = Future()
                root.started.set_result(True)
                ep = root
            else:
                ep = self._text_call(root, prompt, limit)
            ep.calls += 1
            ep.wants_logprobs = wants_logprobs
            answer = ep.answer
        return await asyncio.wrap_future(answer)

    def _text_call(self, root: ProgramEpisode, prompt: str | list[int], limit: int) -> ProgramEpisode:
        """The conversation a later /completions call extends, its next call handed to it; else a new branch."""
        if not root.text_mode:
            raise HTTPError(409, "a /completions call in a chat episode: an episode's calls all go to one route",
                            "episode_branch")
        refused = None
        for ep in (root, *root.branches):
            if not ep.open:
                continue
            try:
                suffix, added = self._text_extension(ep, prompt)
            except HTTPError as e:
                refused = refused or e
                continue
            ep.answer = Future()
            ep.waiting.set_result((suffix, [], limit, added))
            return ep
        if not self.max_branches:
            raise refused
        ids = list(prompt) if isinstance(prompt, list) else list(self.tokenizer(prompt).input_ids)
        return self._branch(root, ids, limit, text_mode=True, text=prompt, first_text=len(prompt))

    def _text_extension(self, ep: ProgramEpisode, prompt: str | list[int]) -> tuple[list[int], str | list[int]]:
        """(the tokens to append, what the prompt adds) of a text conversation's next call; 409 where it does not
        extend it."""
        if ep.waiting is None or ep.waiting.done():
            raise HTTPError(409, "a call while this episode's previous call is unanswered: an episode is one "
                                 "text, one call at a time (max_branches above 0 makes such a call a branch)")
        if type(prompt) is not type(ep.text) or prompt[:len(ep.text)] != ep.text:
            raise HTTPError(409, "this prompt does not extend its episode's text (the prompts sent before and the "
                                 "completions as served, in the first prompt's form: a string or token ids); set "
                                 "max_branches above 0 to train such a call as a branch", "episode_branch")
        added = prompt[len(ep.text):]
        if isinstance(added, list):
            return list(added), added
        return (list(self.tokenizer(added, add_special_tokens=False).input_ids) if added else []), added

    async def chat(self, episode: str, body: dict) -> dict:
        if self.format is None:
            raise HTTPError(400, "the tokenizer has no chat template: this policy serves /completions only")
        messages, tools = _messages(body), body.get("tools")
        wants_logprobs, limit = _logprobs_asked(body), _max_tokens(body)
        if tools is not None and not isinstance(tools, list):
            raise HTTPError(400, "'tools' must be a list of OpenAI tool schemas")
        root = self.by_id[episode]
        with self.lock:
            if not self.has_episode(episode):
                raise HTTPError(404, f"episode {episode!r} has ended", "episode_not_found")
            if root.text_mode:
                raise HTTPError(409, "a /chat/completions call in a text episode: an episode's calls all go to one "
                                     "route", "episode_branch")
            if root.prompt_ids is None:
                root.prompt_ids = self._chat_prompt(messages, tools)
                root.messages, root.tools, root.num_prompt_messages = list(messages), tools, len(messages)
                root.first_limit = limit
                root.answer = Future()
                root.started.set_result(True)
                ep = root
            else:
                ep = self._chat_call(root, messages, tools, limit)
            ep.calls += 1
            ep.wants_logprobs = wants_logprobs
            answer = ep.answer
        return await asyncio.wrap_future(answer)

    def _chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return self.format.prompt_ids(messages, tools)
        except Exception as e:  # noqa: BLE001 - a template that cannot render what was sent
            raise HTTPError(400, f"the chat template cannot render these messages ({e})") from None

    def _chat_call(self, root: ProgramEpisode, messages: list[dict], tools: list[dict] | None,
                   limit: int | None) -> ProgramEpisode:
        """The conversation a later chat call extends, its next call handed to it; else a new branch."""
        refused = None
        for ep in (root, *root.branches):
            if not ep.open:
                continue
            try:
                if ep.waiting is None or ep.waiting.done():
                    raise HTTPError(409, "a call while this episode's previous call is unanswered: an episode is one "
                                         "conversation, one call at a time (max_branches above 0 makes such a call "
                                         "a branch)")
                new = _extension(ep.messages, messages, ep.num_prompt_messages, self.history)
            except HTTPError as e:
                refused = refused or e
                continue
            try:
                suffix = self.format.suffix_ids(new, ep.tools)
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
            ep.answer = Future()
            ep.waiting.set_result((suffix, new, limit, None))
            return ep
        if not self.max_branches:
            raise refused
        return self._branch(root, self._chat_prompt(messages, tools), limit, messages=list(messages), tools=tools,
                            num_prompt_messages=len(messages))

    def _branch(self, root: ProgramEpisode, prompt_ids: list[int], limit: int | None, **conversation) -> ProgramEpisode:
        """A call that extends none of the episode's conversations starts one of its own: one more request of the
        rollout, and one more sample of the episode's group."""
        if len(root.branches) >= self.max_branches:
            raise HTTPError(409, f"this call starts a new conversation (a branch: it extends none of the episode's), "
                                 f"and the episode has max_branches={self.max_branches} already; raise max_branches",
                            "episode_branch")
        branch = ProgramEpisode(f"{root.id}-{len(root.branches) + 1}", root.row, prompt_ids=prompt_ids,
                                first_limit=limit, done=root.done, root=root, root_index=root.root_index,
                                **conversation)
        branch.started.set_result(True)
        branch.answer = Future()
        self.episodes.append(branch)  # before the engine can see its request: a turn of it finds it by index
        try:
            index = self.spawns.add(prompt_ids, limit)
        except RolloutEnded:
            self.episodes.pop()
            raise HTTPError(409, "the rollout has ended (every conversation of every episode had ended): a branch "
                                 "starts while one of its episode's conversations is still open", "episode_branch") \
                from None
        except ValueError as e:
            self.episodes.pop()
            raise HTTPError(400, f"{e} (max_prompt_length plus max_completion_length)",
                            "context_length_exceeded") from None
        if index != len(self.episodes) - 1:
            raise AssertionError(f"branch request {index} is row {len(self.episodes) - 1} of the runner")
        root.branches.append(branch)
        return branch

    # ---- the continuation ----------------------------------------------------------------------------
    # a turn's reply waits for the program's next call: it comes as a Future that the call resolves, so that no
    # thread waits for it
    replies_later = True

    def __call__(self, turn: Turn) -> Future:
        ep = self.episodes[turn.request]
        ids = turn.completion_ids[ep.consumed:]
        logprobs = (turn.logprobs or [])[ep.consumed:] if ep.wants_logprobs else None
        if ep.text_mode:
            message, calls = {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, []
        else:
            message, calls = self.format.parse(ids, ep.prompt_ids + turn.completion_ids[:ep.consumed])
        ep.consumed = len(turn.completion_ids)
        served = message if ep.text_mode else _openai_message(message, ep.calls)
        # a turn cut by the turn limit is a call that ended by length (OpenAI's meaning): the episode goes on until
        # its whole budget is spent
        spent = turn.finish_reason != "stop" and len(turn.completion_ids) >= self.max_completion_length
        with self.lock:
            ep.messages.append(served)
            if ep.text_mode:
                ep.text = ep.text + (ids if isinstance(ep.text, list) else served["content"])
            # a spent budget ends the episode (later calls get 404); so does a program that already returned,
            # having given up on this call (a client timeout, a dropped connection): nothing would call again
            ep.waiting = None if spent or ep.done.is_set() else Future()
            if ep.waiting is None:
                ep.open = False
            waiting = ep.waiting
        # a spent budget is "length" even where a complete tool call was parsed: no call can follow it
        finish = "length" if spent else "tool_calls" if calls else "stop" if turn.finish_reason == "stop" else "length"
        respond = self._text_response if ep.text_mode else self._response
        ep.answer.set_result(respond(ep, served, ids, finish, logprobs))
        reply: Future = Future()
        if waiting is None:
            reply.set_result(Reply(None))
            return reply

        def answered(call: Future) -> None:  # in the thread of the program's next call (or of its end)
            try:
                reply.set_result(self._next_turn(ep, turn, call.result()))
            except BaseException as e:  # noqa: BLE001 - the engine raises it where it waits for the reply
                reply.set_exception(e)

        waiting.add_done_callback(answered)
        return reply

    def _next_turn(self, ep: ProgramEpisode, turn: Turn, nxt) -> Reply:
        """The Reply to `turn` once the program's next call came: (tokens to append, new messages, the call's own
        max_tokens, what a text prompt adds), or None when the program returned."""
        if nxt is None:  # the program returned (or ran out of time): the episode ends with the last turn
            with self.lock:
                ep.open = False
            return Reply(None)
        suffix, new, limit, added = nxt
        if len(turn.completion_ids) + len(suffix) >= self.max_completion_length:
            with self.lock:
                ep.open = False
            ep.answer.set_exception(HTTPError(400, f"the episode reached max_completion_length "
                                                   f"({self.max_completion_length} tokens)", "context_length_exceeded"))
            return Reply(None, "length")
        ep.messages += new
        if added is not None:
            with self.lock:
                ep.text = ep.text + added
        ep.consumed += len(suffix)
        return Reply(suffix, max_turn_tokens=limit)

    def _response(self, ep: ProgramEpisode, message: dict, ids: list[int], finish_reason: str,
                  logprobs: list[float] | None = None) -> dict:
        n = len(ids)
        served = None
        if logprobs is not None:  # OpenAI's shape: each sampled token with its logprob (the sampler's own)
            tokens = [self.format.tokenizer.decode([t]) for t in ids]
            served = {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                  for s, lp in zip(tokens, logprobs)], "refusal": None}
        return {"id": f"chatcmpl-{ep.id}-{ep.calls}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": served}],
                "usage": _usage(ep, n)}

    def _text_response(self, ep: ProgramEpisode, message: dict, ids: list[int], finish_reason: str,
                       logprobs: list[float] | None = None) -> dict:
        """OpenAI's text_completion: the served text and its token ids, and with `logprobs` each sampled token
        with its logprob."""
        n, text = len(ids), message["content"]
        served = None
        if logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in ids]
            offsets = [0, *itertools.accumulate(map(len, tokens[:-1]))] if tokens else []
            served = {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
                      "text_offset": offsets}
        return {"id": f"cmpl-{ep.id}-{ep.calls}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                # `token_ids`: the sampled tokens, as vLLM returns them, so that a program can extend the episode in
                # token ids without tokenizing the text again
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": served,
                             "token_ids": list(ids)}],
                "usage": _usage(ep, n)}

    # ---- after the rollout ---------------------------------------------------------------------------
    def record(self) -> Episodes:
        """The episodes once every program returned: their messages, the programs' return values (the column
        `agent_returns`, which the `agent` reward reads) and metrics. A program that raised fails the step.
        Branches are rows of the rollout after the episodes' (`Episodes.branch_of`)."""
        roots = self.episodes[:self.num_episodes]
        for i, ep in enumerate(roots):
            remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0) + 5.0
            if not ep.done.wait(remaining):
                raise TimeoutError(f"agent program {_name(self.program)}: episode {i} did not return within its "
                                   f"timeout of {self.timeout} s")
            if ep.error is not None:
                if isinstance(ep.error, asyncio.TimeoutError):
                    raise TimeoutError(f"agent program {_name(self.program)}: episode {i} ran past its timeout of "
                                       f"{self.timeout} s (agent_timeout)") from None
                raise RuntimeError(f"agent program {_name(self.program)} raised in episode {i} (row "
                                   f"{_brief(ep.row)}): {type(ep.error).__name__}: {ep.error}") from ep.error
            if ep.result is not None and not isinstance(ep.result, (int, float)):
                raise TypeError(f"agent program {_name(self.program)} returned a {type(ep.result).__name__} in "
                                f"episode {i}: return the episode's reward (a number) or None")
        n, branches = max(len(roots), 1), self.episodes[self.num_episodes:]
        metrics = {"episodes/mean_turns": sum(sum(m["role"] == "assistant" for m in e.messages)
                                              for e in self.episodes) / n,
                   "episodes/mean_calls": sum(e.calls for e in self.episodes) / n}
        if self.max_branches:
            metrics["episodes/mean_branches"] = len(branches) / n
        return Episodes(Later(lambda i: self._completion_of(roots[i]), len(roots)), None, metrics,
                        columns={"agent_returns": [None if e.result is None else float(e.result) for e in roots]},
                        branch_of=[b.root_index for b in branches])

    def _completion_of(self, ep: ProgramEpisode) -> list[dict] | str:
        """What the rewards get: a chat episode's messages after its prompt; a text episode's text after its first
        prompt (decoded, where its prompts were token ids)."""
        if not ep.text_mode:
            return ep.messages[ep.num_prompt_messages:]
        rest = ep.text[ep.first_text:]
        return self.tokenizer.decode(rest, skip_special_tokens=True) if isinstance(rest, list) else rest

    def close(self) -> None:
        returned = all(ep.done.is_set() for ep in self.episodes)
        for ep in self.episodes[:self.num_episodes]:
            self._ended(ep)
        self.endpoint.stop()
        if self._workers is not None:
            if self._run is not None:
                if not returned:
                    self._workers.cancel(self._run)
                self._workers.finish(self._run, TEARDOWN_S)
            return
        if self._thread is None:
            return
        if returned:  # the programs' own teardown (their shared client, an environment's servers) ends by itself
            self._thread.join(TEARDOWN_S)
        if self._thread.is_alive():
            for task in asyncio.all_tasks(self._loop) if not self._loop.is_closed() else []:
                self._loop.call_soon_threadsafe(task.cancel)
            self._thread.join(10)


class Later(abc.Sequence):
    """Items computed when first read: the episodes' completions, which the score phase reads, so that decoding a
    text episode's tokens is the score phase's time and not the rollout's."""

    def __init__(self, make: Callable[[int], Any], n: int):
        self._make, self._n = make, n
        self._made: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(i)
        if j not in self._made:
            self._made[j] = self._make(j)
        return self._made[j]

    def __eq__(self, other) -> bool:
        return isinstance(other, (abc.Sequence)) and not isinstance(other, str) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


def agent_reward(agent_returns, **kwargs) -> list[float | None]:
    """The `agent` reward: what each episode's program returned (None: no score from it)."""
    return list(agent_returns)


def _logprobs_asked(body: dict) -> bool:
    """OpenAI's `logprobs` (a bool); `top_logprobs` above 0 is refused: the engine keeps the sampled token's only."""
    wanted, top = body.get("logprobs") or False, body.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise HTTPError(400, f"'logprobs' must be true or false, got {wanted!r}")
    if top not in (None, 0):
        raise HTTPError(400, f"top_logprobs={top!r}: the endpoint serves each sampled token's own logprob "
                             "(logprobs: true), not the alternatives; drop top_logprobs")
    return wanted


def _usage(ep: ProgramEpisode, n: int) -> dict:
    """OpenAI's token counts of a call that sampled `n` tokens: its prompt is the episode so far."""
    total = len(ep.prompt_ids) + ep.consumed
    return {"prompt_tokens": total - n, "completion_tokens": n, "total_tokens": total}


DEFAULT_TEXT_TOKENS = 16  # OpenAI's max_tokens default for /completions (vLLM's too)


def _prompt(body: dict, vocab_size: int) -> str | list[int]:
    """A /completions call's one prompt: a string or a list of token ids (a batch of prompts is refused)."""
    prompt = body.get("prompt")
    for name in ("suffix", "echo", "best_of", "n"):
        if body.get(name) not in (None, False, 1):
            raise HTTPError(400, f"{name}={body[name]!r} is not served: an episode's call samples one continuation")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    # map, set, min and max run in C: a long episode's prompt is checked on every call
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            raise HTTPError(400, f"prompt token ids {bad[:3]} are outside the vocabulary (0..{vocab_size - 1})")
        return prompt
    raise HTTPError(400, "'prompt' must be one non-empty string or one non-empty list of token ids (an episode is "
                         "one text: a batch of prompts is several episodes)")


def _text_logprobs_asked(body: dict) -> bool:
    """/completions' `logprobs` is a count of alternatives: 0 serves each sampled token's own logprob, as the
    engine keeps it; more is refused."""
    wanted = body.get("logprobs")
    if wanted is None or wanted is False:
        return False
    if wanted is True or wanted == 0:
        return True
    raise HTTPError(400, f"logprobs={wanted!r}: the endpoint serves each sampled token's own logprob (logprobs: 0), "
                         "not the alternatives")


def _max_tokens(body: dict) -> int | None:
    """The call's own bound on what it samples: OpenAI's `max_completion_tokens`, or the older `max_tokens`."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise HTTPError(400, f"max_tokens must be a positive integer, got {value!r}")
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                  for m in messages):
        raise HTTPError(400, "'messages' must be a non-empty list of {'role', 'content'} objects")
    return [dict(m, content=_text_content(m["content"])) if isinstance(m.get("content"), list) else m
            for m in messages]


def _text_content(parts: list) -> str:
    """OpenAI's content parts ([{"type": "text", "text": ...}], as agent frameworks send them) as the one string a
    chat template renders, joined by newlines as vLLM joins them for such templates."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise HTTPError(400, f"only text content parts are supported, got one of type {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _same(a: dict, b: dict) -> bool:
    """Two messages are the same turn when their role, text and tool calls' names and arguments agree."""
    def calls(m):
        return [(c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
                for c in m.get("tool_calls") or []]
    return (a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")
            and calls(a) == calls(b))


def _arguments(value):
    if isinstance(value, str):
        import json

        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


HISTORIES = ("exact", "served")  # agent_history: what a later call's earlier assistant messages must be


def _extension(before: list[dict], messages: list[dict], num_prompt_messages: int = 0,
               history: str = "exact") -> list[dict]:
    """The messages a call adds after the conversation so far, or HTTP 409 when it does not extend it. With
    history "served", an assistant message where the endpoint served a turn stands for that turn in whatever form
    the program wrote it back (smolagents writes tool calls back as text): the episode keeps the served tokens."""
    def agrees(i: int, a: dict, b: dict) -> bool:
        if history == "served" and i >= num_prompt_messages and a.get("role") == "assistant":
            return b.get("role") == "assistant"
        return _same(a, b)

    if len(messages) <= len(before) or not all(agrees(i, a, b) for i, (a, b) in enumerate(zip(before, messages))):
        hint = "" if history == "served" else (" (a program or framework that writes the served turns back in a form "
                                                "of its own, as smolagents does, needs agent_history: served)")
        raise HTTPError(409, "this call does not extend its episode's conversation (the messages sent before, "
                             "the assistant message as served, then new ones); branching within an episode is not "
                             "supported yet" + hint, "episode_branch")
    new = messages[len(before):]
    if any(m.get("role") == "assistant" for m in new):
        raise HTTPError(409, "the new messages hold an assistant message the endpoint did not serve", "episode_branch")
    return [{k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")} for m in new]


def _openai_message(message: dict, call: int) -> dict:
    """A parsed assistant turn in OpenAI's schema: tool calls with ids and JSON-string arguments."""
    import json

    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": f"call_{call}_{i}", "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"].get("arguments") or {})}}
                             for i, c in enumerate(message["tool_calls"])]
    return out


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _brief(row: dict) -> str:
    text = repr(row)
    return text if len(text) <= 80 else text[:77] + "..."
