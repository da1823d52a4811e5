from rlcu.rollout.base import (
    Capabilities,
    RolloutBackend,
    RolloutBatch,
    SamplingParams,
    capabilities_of,
    require,
    resolve_rollout,
)

__all__ = ["Capabilities", "RolloutBackend", "RolloutBatch", "SamplingParams", "capabilities_of", "require",
           "resolve_rollout"]
