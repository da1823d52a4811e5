from rlcu.rollout.base import RolloutBackend, RolloutBatch, SamplingParams

__all__ = ["RolloutBackend", "RolloutBatch", "SamplingParams"]
