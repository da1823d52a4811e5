from rlcu.rollout.base import (
    Capabilities,
    RolloutBackend,
    RolloutBatch,
    SamplingParams,
    bind,
    capabilities_of,
    require,
    resolve_rollout,
)

__all__ = ["bind", "Capabilities", "RolloutBackend", "RolloutBatch", "SamplingParams", "capabilities_of", "require",
           "resolve_rollout"]
