"""Environments, one instance per episode.

TRL's `environment_factory` (a callable, or `{name: callable}` chosen per row by an `environment` column)
makes objects with `reset(**row) -> str | None` (appended to the last user message), public methods that
the model calls as tools, and optionally `get_reward() -> float` (an extra reward, weight 1, named after
the class). `TextEnvironment` is rlcu's multi-turn kind beyond tools: it answers each assistant turn
with a user message (`step`) until it sets `done` (games, feedback loops). Both kinds can be named in
YAML by short name (the `rlcu.environments` entry-point group) or import path, with init_args.

Instances are made once and reset for each episode (TRL's "construct once, reset often"), and more are
made only when a batch needs more at once."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from rlcu import plugins

NOT_TOOLS = ("reset", "get_reward")


class TextEnvironment:
    """A multi-turn environment: `reset(**row)` starts an episode (its return value, if any, is appended to
    the prompt's last user message), `step(message)` answers the assistant's turn with the next user
    message, and setting `done = True` ends the episode (the answer returned with it is not shown).
    `get_reward()`, when defined, scores the episode. Public methods other than these are tools."""
    done: bool = False

    def reset(self, **row) -> str | None:
        self.done = False
        return None

    def step(self, message: str) -> str:
        raise NotImplementedError


def tool_methods(instance) -> list[Callable]:
    """The environment's tools: public functions of its class (listed on the class, so properties are not
    evaluated), less reset and get_reward (and step, for a TextEnvironment)."""
    skip = NOT_TOOLS + (("step",) if isinstance(instance, TextEnvironment) else ())
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in skip and not name.startswith("_")]


def _is_spec_mapping(spec) -> bool:
    return isinstance(spec, dict) and ("class_path" in spec or "init_args" in spec)


class Environments:
    def __init__(self, spec):
        """`spec`: a factory (class or function), a name / import path, {class_path, init_args}, or a dict
        {environment name: any of those} selected per row by its `environment` column."""
        self.multi = isinstance(spec, dict) and not _is_spec_mapping(spec)
        specs = spec if self.multi else {None: spec}
        self.factories = {name: plugins.factory("environments", s) for name, s in specs.items()}
        self.pools: dict = {}
        self.reward_classes: list[type] = []
        for name, make in self.factories.items():  # one probe per environment: checks it, and starts its pool
            instance = make()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"environment {name or type(instance).__name__!r} has no reset(**row) method; each "
                                 "environment must define one")
            self.pools[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def name_of(self, row: dict):
        if not self.multi:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"row has environment={name!r}, not one of the environments given to "
                             f"environment_factory: {sorted(self.factories)}")
        return name

    def checkout(self, rows: list[dict]) -> list:
        """One instance per row, reused across batches (made only when this batch needs more)."""
        taken: dict = {}
        out = []
        for row in rows:
            name = self.name_of(row)
            pool, i = self.pools[name], taken.get(name, 0)
            if i == len(pool):
                pool.append(self.factories[name]())
            taken[name] = i + 1
            out.append(pool[i])
        return out

    def rewards(self) -> list[tuple[str, Callable]]:
        """(class name, reward function) for each environment class that scores its episodes (TRL's rule:
        an episode of another class gets None)."""
        def reward_of(cls):
            def environment_reward(environments, **kwargs):
                values = [e.get_reward() if type(e) is cls else None for e in environments]
                return [asyncio.run(v) if inspect.isawaitable(v) else v for v in values]
            return environment_reward
        return [(cls.__name__, reward_of(cls)) for cls in self.reward_classes]
