"""SIGTERM (a scheduler's pre-emption) or Ctrl-C: finish the step in progress, save a checkpoint, stop.

Lightning already turns SIGTERM into a stop at the end of the current batch; this callback saves a
checkpoint there, and gives Ctrl-C the same treatment (a second Ctrl-C stops at once). A crash in the
middle of a step saves nothing here: its state may be half-updated, and the periodic checkpoints stand."""
from __future__ import annotations

import signal
import threading

from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

STOPPED_BY: list[str] = []  # the signal that stopped the run, once one did ("SIGINT"), for the exit code


class SaveOnInterrupt(OnExceptionCheckpoint):
    def __init__(self, dirpath: str, filename: str = "interrupted"):
        super().__init__(dirpath, filename)
        self._previous = None

    def on_fit_start(self, trainer, pl_module) -> None:
        STOPPED_BY.clear()  # a run before this one in the same process may have been stopped
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda signum, frame: self._on_sigint(trainer))

    def _on_sigint(self, trainer) -> None:
        if trainer.received_sigterm:
            raise KeyboardInterrupt
        rank_zero_info("\nCtrl-C: stopping at the end of this step, or between two decode steps of a rollout, then "
                       "saving a checkpoint (press Ctrl-C again to stop at once)")
        STOPPED_BY.append("SIGINT")
        trainer._signal_connector.received_sigterm = True  # Lightning's own stop at the end of this batch

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            super().on_exception(trainer, pl_module, exception)
            rank_zero_info(f"saved {self.ckpt_path} at step {trainer.global_step}; "
                           f"resume with --ckpt_path={self.ckpt_path}")
