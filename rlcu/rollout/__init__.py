from rlcu.rollout.base import (
    Capabilities,
    RolloutBackend,
    RolloutBatch,
    RolloutStream,
    SamplingParams,
    bind,
    capabilities_of,
    require,
    resolve_rollout,
)

__all__ = ["bind", "Capabilities", "RolloutBackend", "RolloutBatch", "RolloutStream", "SamplingParams",
           "capabilities_of", "require", "resolve_rollout"]
