"""Environments of prime-rl's `verifiers` (0.4, the `verifiers.v1` stack: a taskset, its tasks' `@vf.reward`
rubric, and a harness that plays the multi-turn protocol) as an rlcu agent program.

    env = VerifiersEnvironment("my_taskset")          # or a verifiers EnvConfig (or its dict), or a built vf.Env
    module = GRPOModule(model, tokenizer=tok, agent=env, ...)
    data = PromptDataModule(env.rows(), ...)          # one row a task: its prompt and its index

Each episode runs `env.run_episode(task, ctx)` with the model context pointed at the episode's base URL on rlcu's
endpoint: the harness's calls go through verifiers' own interception server to the endpoint, so the policy samples
every turn (token in, token out) and the tokens the harness adds are masked out of the loss, as for any agent
program. The episode's reward is its traces' reward (the task's weighted `@vf.reward` functions), the `agent`
reward. An episode that fails (a harness or task error, its timeout) stops the step with verifiers' errors.

A harness that launches a program in a runtime (verifiers' `bash`, `codex`, ...) needs that runtime (uv, a
container) on the machine; one that runs its loop in-process (docs/agents.md) needs nothing more."""
from __future__ import annotations

import asyncio
import os
from typing import Any

KEY_VAR = "RLCU_AGENT_ENDPOINT_KEY"  # verifiers reads a client's API key from an environment variable


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ImportError("VerifiersEnvironment needs the verifiers package: pip install 'verifiers==0.4.0'") from None
    return vf


class VerifiersEnvironment:
    """A verifiers environment as an agent program `(endpoint, row) -> reward` (module docstring)."""

    def __init__(self, env: Any, runtime: str = "subprocess"):
        """`env`: a taskset id (a module exporting its `vf.Taskset`), a verifiers env config or its dict, or a built
        `vf.Env`. `runtime`: the agent's runtime type where `env` does not set one (`subprocess`: this machine)."""
        vf = _vf()
        if isinstance(env, str):
            env = {"taskset": {"id": env}}
        if isinstance(env, dict):
            env = {**env, "agent": {"runtime": {"type": runtime}, **env.get("agent", {})}}
            env = vf.SingleAgentEnvConfig(**env)
        if not isinstance(env, vf.Env):
            env = vf.load_environment(env)
        self.env = env
        if not getattr(env.taskset, "bounded", True):
            raise ValueError(f"verifiers taskset {env.config.taskset.id!r} is infinite: take a bounded view of it "
                             "(taskset.take(n)) for rlcu's rows")
        self.tasks = list(env.taskset)
        self._serving: dict[asyncio.AbstractEventLoop, list] = {}  # per event loop: [context, episodes in it, ready]

    def rows(self) -> list[dict]:
        """One row a task, for rlcu's data module: the task's prompt and its index (`vf_task`)."""
        return [{"prompt": task.data.prompt, "vf_task": i} for i, task in enumerate(self.tasks)]

    async def __call__(self, endpoint, row: dict) -> float:
        vf = _vf()
        index = row.get("vf_task")
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise ValueError(f"row has no task of this environment (vf_task={index!r}); give the data module "
                             "VerifiersEnvironment.rows()")
        os.environ[KEY_VAR] = endpoint.api_key
        ctx = vf.ModelContext(model=endpoint.model,
                              client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=KEY_VAR))
        async with _Served(self):
            episode = await self.env.run_episode(self.tasks[index], ctx)
        if not episode.ok:
            errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "a trace did not finish"
            raise RuntimeError(f"verifiers episode of task {index} failed: {errors}")
        return sum(trace.reward for trace in episode.traces) / len(episode.traces)


def taskset_rows(env: Any, runtime: str = "subprocess") -> list[dict]:
    """The rows of a verifiers environment's tasks, as a data source (`dataset: rlcu.agents.verifiers:taskset_rows`,
    `dataset_args: {env: my_taskset}`), beside `agent: {class_path: rlcu.agents.verifiers.VerifiersEnvironment,
    init_args: {env: my_taskset}}`."""
    return VerifiersEnvironment(env, runtime).rows()


class _Served:
    """The environment's serving resources (`env.serving()`: its interception server, shared tools), held by one
    rollout's episodes together on their event loop: entered by the first, left by the last. An env holds one
    interception at a time, so concurrent episodes cannot each enter their own."""

    def __init__(self, owner: VerifiersEnvironment):
        self.owner = owner

    async def __aenter__(self):
        loop = asyncio.get_running_loop()
        held = self.owner._serving.setdefault(loop, [None, 0, asyncio.Event()])
        held[1] += 1
        if held[1] == 1 and held[0] is None:
            held[0] = self.owner.env.serving()
            try:
                await held[0].__aenter__()
            except BaseException:
                del self.owner._serving[loop]
                held[2].set()
                raise
            held[2].set()
        await held[2].wait()
        if loop not in self.owner._serving:
            raise RuntimeError("the verifiers environment could not start serving (the first episode's error)")

    async def __aexit__(self, *exc):
        loop = asyncio.get_running_loop()
        held = self.owner._serving[loop]
        held[1] -= 1
        if held[1] == 0:
            del self.owner._serving[loop]
            await held[0].__aexit__(None, None, None)
