from rlcu.callbacks.completions import CompletionsTable
from rlcu.callbacks.interrupt import SaveOnInterrupt
from rlcu.callbacks.plot import RewardPlot
from rlcu.callbacks.progress import StepProgressBar

__all__ = ["CompletionsTable", "RewardPlot", "SaveOnInterrupt", "StepProgressBar"]
