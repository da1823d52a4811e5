from rlcu.rewards.base import BoundReward, Reward, RewardError, completion_text, resolve_rewards, score

__all__ = ["BoundReward", "Reward", "RewardError", "completion_text", "resolve_rewards", "score"]
