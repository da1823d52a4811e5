"""Plugins are Python entry points. A package registers rewards under `rlcu.rewards`, rollout backends
under `rlcu.rollouts`, multi-turn environments under `rlcu.environments` and loss types or advantage
estimators under `rlcu.losses`; YAML names them by short
name or by import path (`pkg.module:attr` or `pkg.module.attr`). Plain Python objects work everywhere
too: no registry is required."""
from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

GROUPS = {"rewards": "rlcu.rewards", "rollouts": "rlcu.rollouts", "environments": "rlcu.environments",
          "losses": "rlcu.losses"}


class UnknownPluginError(LookupError):
    pass


def available(kind: str) -> dict[str, EntryPoint]:
    """Short name -> entry point, for a kind of GROUPS ('rewards', 'rollouts', 'environments')."""
    if kind not in GROUPS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {sorted(GROUPS)}")
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


def import_path(path: str):
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ImportError(f"{path!r} is not an import path (use 'package.module:attr')")
    return getattr(importlib.import_module(module), attr)


def load(kind: str, name: str):
    """The object (class or function) registered as `name`, or found at import path `name`."""
    found = available(kind)
    if name in found:
        return found[name].load()
    if ":" in name or "." in name:
        try:
            return import_path(name)
        except (ImportError, AttributeError) as e:
            raise UnknownPluginError(f"cannot import {kind[:-1]} {name!r}: {e}") from e
    raise UnknownPluginError(
        f"unknown {kind[:-1]} {name!r}; available: {', '.join(sorted(found)) or 'none'}. "
        f"Install a package that registers it under the '{GROUPS[kind]}' entry-point group, "
        f"or give an import path such as 'my_pkg.{kind}:my_{kind[:-1]}'.")


def _unpack(kind: str, spec, extra_keys: tuple[str, ...] = ()):
    """(target, init_args, extras) of a spec; a mapping is {name | class_path: ..., init_args: {...}, extras...}."""
    if not isinstance(spec, dict):
        return spec, {}, {}
    spec = dict(spec)
    target = spec.pop("name", None) or spec.pop("class_path", None)
    init_args = spec.pop("init_args", None) or {}
    extras = {k: spec.pop(k) for k in extra_keys if k in spec}
    if target is None or spec:
        allowed = ["name (or class_path)", "init_args", *extra_keys]
        raise ValueError(f"a {kind[:-1]} given as a mapping takes {allowed}; got unexpected keys "
                         f"{sorted(spec) or ['(no name)']}")
    return target, init_args, extras


def build(kind: str, spec, extra_keys: tuple[str, ...] = ()):
    """An object from a spec: an instance (returned as is), a class (instantiated), a short name or
    import path, or a mapping {name | class_path: ..., init_args: {...}, <extra_keys>...}.

    Returns (object, extras): `extras` holds the mapping's `extra_keys` (for example a reward's weight)."""
    spec, init_args, extras = _unpack(kind, spec, extra_keys)
    if isinstance(spec, str):
        spec = load(kind, spec)
    if isinstance(spec, type) or (init_args and callable(spec)):  # a class, or a factory given its arguments
        spec = spec(**init_args)
    elif init_args:
        raise ValueError(f"init_args were given for {getattr(spec, '__name__', spec)!r}, which is not callable")
    return spec, extras


def factory(kind: str, spec):
    """A zero-argument callable that makes a new object per call (an environment per episode), from a
    callable (a class or a function, returned as is), a short name or import path, or a mapping
    {name | class_path: ..., init_args: {...}}."""
    spec, init_args, _ = _unpack(kind, spec)
    if isinstance(spec, str):
        spec = load(kind, spec)
    if not callable(spec):
        raise TypeError(f"a {kind[:-1]} factory must be callable (a class or a function), got {type(spec).__name__}")
    return (lambda: spec(**init_args)) if init_args else spec
