from rlcu.callbacks.completions import CompletionsTable
from rlcu.callbacks.interrupt import SaveOnInterrupt
from rlcu.callbacks.plot import RewardPlot

__all__ = ["CompletionsTable", "RewardPlot", "SaveOnInterrupt"]
