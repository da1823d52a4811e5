"""The agent loop as a continuation: after each assistant turn, parse its tool calls and run them (or let
a `TextEnvironment` answer), and hand the rollout backend the tokens of the messages that follow. The
backend (the engine, or the turn-by-turn loop) owns the batching; this owns the conversation.

An episode's completion is every assistant turn and every tool or environment message after the prompt,
bounded as a whole by `max_completion_length`: a result that would leave no room for the model's next
token is rolled back and the episode ends truncated ("length"), as TRL rolls it back. A turn that ends by
length ends the episode. `max_tool_calling_iterations` bounds the rounds of tool calls (TRL's meaning)."""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlcu import plugins
from rlcu.agents.environments import Environments, TextEnvironment, tool_methods
from rlcu.agents.formats import ToolFormat, tool_format
from rlcu.agents.tools import MAX_RESULT_CHARS, ToolBox, tool_message
from rlcu.calls import call_bounded
from rlcu.contracts import Reply, Turn


@dataclass
class AgentOptions:
    format: ToolFormat
    tools: list[Callable] = field(default_factory=list)
    environments: Environments | None = None
    max_tool_calling_iterations: int | None = None  # None: no bound
    max_completion_length: int = 256
    tool_timeout: float | None = 60.0
    max_result_chars: int = MAX_RESULT_CHARS
    tool_isolation: str = "thread"  # "process": the plain tools run in forked processes (never an environment's)

    @classmethod
    def build(cls, tokenizer, tools=None, environment_factory=None, tool_format_name: str = "template",
              max_tool_calling_iterations: int | None = None, max_completion_length: int = 256,
              tool_timeout: float | None = 60.0, max_result_chars: int = MAX_RESULT_CHARS,
              template_kwargs: dict | None = None, tool_isolation: str = "thread") -> "AgentOptions | None":
        """The options of a run with tools or environments (None for neither). Tools may be given as
        callables or, from YAML, as import paths ('my_pkg.tools:multiply')."""
        if not tools and environment_factory is None:
            return None
        functions = [_tool(t) for t in tools or []]
        ToolBox(functions)  # checks names and docstrings now, not at the first rollout
        environments = Environments(environment_factory) if environment_factory is not None else None
        return cls(tool_format(tool_format_name, tokenizer, template_kwargs), functions, environments,
                   max_tool_calling_iterations, max_completion_length, tool_timeout, max_result_chars, tool_isolation)


def _tool(spec):
    """A tool given as a callable, or from YAML as an import path."""
    if not isinstance(spec, str):
        return spec
    try:
        return plugins.import_path(spec)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import the tool {spec!r} ({e}); give an import path such as "
                         "'my_pkg.tools:multiply'") from e


@dataclass
class Episode:
    messages: list[dict]  # the prompt's messages, then the episode's
    num_prompt_messages: int
    tools: ToolBox
    environment: object | None = None
    consumed: int = 0  # completion tokens already turned into messages
    turns: int = 0  # assistant turns
    tool_rounds: int = 0
    tool_calls: int = 0
    tool_failures: int = 0


@dataclass
class Episodes:
    """A rollout's episodes after they ran: plain data for scoring and metrics."""
    # [N] each episode's messages after its prompt (TRL's `completions[i]`), or a text episode's text after its first
    # prompt; a sequence that may compute them when read (an agent program's text episodes are decoded then)
    completions: Sequence[list[dict] | str]
    environments: list | None  # [N] each episode's environment (TRL's `environments` column), None without
    metrics: dict[str, float]  # tools/call_frequency, tools/failure_frequency, episodes/mean_turns
    columns: dict[str, list] = field(default_factory=dict)  # [N] each, for the rewards (agent programs' returns)
    # an agent program's branches (`programs.py`): the rollout's rows after the N episodes', each one's episode
    branch_of: list[int] = field(default_factory=list)


class EpisodeRunner:
    def __init__(self, rows: list[dict], options: AgentOptions, stop_requested: Callable[[], bool] | None = None):
        """One episode per row (the rows already repeated per generation)."""
        self.options, self.stop_requested = options, stop_requested
        envs = options.environments.checkout(rows) if options.environments else [None] * len(rows)
        self.episodes = [self._start(row, env) for row, env in zip(rows, envs)]
        fmt = options.format
        self.prompt_ids = [fmt.prompt_ids(e.messages, e.tools.schemas) for e in self.episodes]

    def _start(self, row: dict, env) -> Episode:
        prompt = row["prompt"]
        if not isinstance(prompt, list):
            raise ValueError("tools and environments need chat prompts (a list of {'role', 'content'} messages), "
                             f"got a {type(prompt).__name__}")
        messages = [dict(m) for m in prompt]
        if env is not None:
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.options.environments.multi else row
            observation = env.reset(**kwargs)
            if observation is not None:  # TRL: appended to the last user message
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        functions = list(self.options.tools) + (tool_methods(env) if env is not None else [])
        # an environment's methods change its state, which its rewards read: they run in this process
        in_process = frozenset(t.__name__ for t in self.options.tools) if self.options.tool_isolation == "process" \
            else frozenset()
        box = ToolBox(functions, self.options.tool_timeout, self.stop_requested, self.options.max_result_chars,
                      in_process)
        return Episode(messages, len(prompt), box, env)

    # ---- the continuation ----------------------------------------------------------------------------
    def __call__(self, turn: Turn) -> Reply:
        ep = self.episodes[turn.request]
        message, calls = self.options.format.parse(turn.completion_ids[ep.consumed:],
                                                   self.prompt_ids[turn.request] + turn.completion_ids[:ep.consumed])
        ep.consumed = len(turn.completion_ids)
        ep.messages.append(message)
        ep.turns += 1
        if turn.finish_reason != "stop":
            return Reply(None)
        if calls and ep.tool_rounds < (self.options.max_tool_calling_iterations or sys.maxsize):
            new = self._run_tools(ep, calls)
        elif isinstance(ep.environment, TextEnvironment):
            new = self._environment_answer(ep, message["content"])
        else:
            new = None
        if not new:
            return Reply(None)
        suffix = self.options.format.suffix_ids(new, ep.tools.schemas)
        if len(turn.completion_ids) + len(suffix) >= self.options.max_completion_length:
            return Reply(None, "length")  # rolled back: the messages are not kept
        ep.messages += new
        ep.consumed += len(suffix)
        return Reply(suffix)

    def _run_tools(self, ep: Episode, calls) -> list[dict]:
        ep.tool_rounds += 1
        out = []
        for call in calls:
            result, failed = ep.tools.run(call)
            ep.tool_calls += 1
            ep.tool_failures += failed
            out.append(tool_message(call.name, result))
        return out

    def _environment_answer(self, ep: Episode, content: str) -> list[dict] | None:
        env = ep.environment
        answer = call_bounded(env.step, {"message": content}, self.options.tool_timeout,
                              f"{type(env).__name__}.step", self.stop_requested)
        if isinstance(answer, BaseException):
            raise RuntimeError(f"environment {type(env).__name__}.step failed: {answer}") from answer
        if env.done or answer is None:
            return None
        return [{"role": "user", "content": str(answer)}]

    # ---- after the rollout ---------------------------------------------------------------------------
    def record(self) -> "Episodes":
        """What the rest of the step needs of the episodes, as plain data."""
        return Episodes(self.completions, self.environments, self.metrics())

    @property
    def completions(self) -> list[list[dict]]:
        """Each episode's messages after the prompt: what TRL's rewards get as `completions[i]`."""
        return [e.messages[e.num_prompt_messages:] for e in self.episodes]

    @property
    def environments(self) -> list | None:
        return None if self.options.environments is None else [e.environment for e in self.episodes]

    def metrics(self) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per episode) and tools/failure_frequency (per call), and
        episodes/mean_turns (assistant turns per episode)."""
        n = max(len(self.episodes), 1)
        calls = sum(e.tool_calls for e in self.episodes)
        failures = sum(e.tool_failures for e in self.episodes)
        return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / calls if calls else 0.0,
                "episodes/mean_turns": sum(e.turns for e in self.episodes) / n}
