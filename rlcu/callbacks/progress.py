"""The progress bar of rlcu runs: Lightning's rich bar, labelled "Epoch N" where Lightning's says "Epoch 0/-2"
(a run bounded by max_steps has max_epochs -1, and the bar prints max_epochs - 1)."""
from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    # Lightning has no public hook for the bar's label; tests/unit/test_cli.py pins the versions this was tested with
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = description.replace(f"/{self.trainer.max_epochs - 1}", "")
        return description
