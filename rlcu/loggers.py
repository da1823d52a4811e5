"""Loggers for runs: Lightning's WandbLogger, offline when no API key is configured (so it works on
machines without network), and a check that drops it with a warning where wandb is not installed."""
from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger

log = logging.getLogger(__name__)


def wandb_available() -> bool:
    return importlib.util.find_spec("wandb") is not None


def has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(Path.home() / ".netrc").authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class WandbLogger(_LightningWandbLogger):
    """`offline=None` (the default) means: online if an API key is configured, else offline. Offline runs
    land in `save_dir/wandb/offline-run-*`; `wandb sync` uploads them later."""

    def __init__(self, project: str = "rlcu", name: str | None = None, save_dir: str = "runs",
                 offline: bool | None = None, **kwargs):
        if offline is None:
            offline = not has_wandb_key()
        # absolute, because wandb's long-lived service process resolves relative paths against its own cwd
        save_dir = str(Path(save_dir).resolve())
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(project=project, name=name, save_dir=save_dir, offline=offline, **kwargs)

    def finalize(self, status: str) -> None:
        # Lightning leaves the wandb run open, so a second fit in the same process would log into it.
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None
