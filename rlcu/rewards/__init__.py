from rlcu.rewards.base import BoundReward, Reward, RewardError, completion_text, resolve_rewards
from rlcu.rewards.scoring import score

__all__ = ["BoundReward", "Reward", "RewardError", "completion_text", "resolve_rewards", "score"]
