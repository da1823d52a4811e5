"""The one place where rlcu silences what its runs print that a user cannot act on, each with the reason.
Real warnings stay; `install()` is idempotent and runs when the `rlcu` command or a GRPOModule starts."""
from __future__ import annotations

import logging
import warnings

# (message regex, why): Python warnings raised inside libraries during an rlcu run
WARNINGS = (
    (r".*isinstance\(treespec, LeafSpec\)` is deprecated",
     "Lightning's own pytree helper calls an API that torch 2.13 deprecates; nothing in the user's code or config"),
    (r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
     "GRPOModule steps its optimizer itself, and the state after the step is the one to resume from; Lightning's "
     "eleven lines, at each periodic save, propose keeping the state before it"),
    (r".*does not have many workers which may be a bottleneck",
     "a step's prompts are a few rows: loader worker processes would only cost memory and start-up"),
)
# (logger, text in the record, why): log lines of libraries
LOG_LINES = (
    ("lightning.pytorch.utilities.rank_zero", "litlogger",
     "an advertisement for a logging service, printed at every Trainer start"),
    ("lightning.fabric.utilities.rank_zero", "litlogger",
     "an advertisement for a logging service, printed at every Trainer start"),
)


class _DropText(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    for pattern, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, text, _why in LOG_LINES:
        logging.getLogger(name).addFilter(_DropText(text))
    _installed = True
