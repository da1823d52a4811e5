"""Agents: multi-turn episodes with tools (TRL's `tools`), environments (TRL's `environment_factory`,
and rlcu's `TextEnvironment`), run as a continuation of any rollout backend (docs/agents.md)."""
from rlcu.agents.environments import Environments, TextEnvironment
from rlcu.agents.episodes import AgentOptions, EpisodeRunner, Episodes
from rlcu.agents.formats import tool_format

__all__ = ["AgentOptions", "Environments", "EpisodeRunner", "Episodes", "TextEnvironment", "tool_format"]
