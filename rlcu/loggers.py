"""Loggers for runs: Lightning's WandbLogger, offline when no API key is configured (so it works on
machines without network), and a check that drops it with a warning where wandb is not installed."""
from __future__ import annotations

import importlib.util
import logging
import netrc
import os
import shutil
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
        super().__init__(project=project, name=name, save_dir=save_dir, offline=offline, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # Lightning passes None, which wandb warns about at every run
            self._wandb_init.pop("anonymous", None)

    @property
    def experiment(self):
        # the folder is made when the run begins, not when the option is read: a run whose model or data fails to
        # build leaves no empty runs/ behind
        if self._experiment is None:
            Path(self.save_dir).mkdir(parents=True, exist_ok=True)
        return super().experiment

    def log_metrics(self, metrics, step=None) -> None:
        self._logged_any = True
        super().log_metrics(metrics, step)

    def finalize(self, status: str) -> None:
        # Lightning leaves the wandb run open, so a second fit in the same process would log into it.
        super().finalize(status)
        if self._experiment is None:
            return
        experiment, self._experiment = self._experiment, None
        try:  # never let the clean-up hide the error that failed the run
            run_dir = Path(experiment.dir).parent
            experiment.finish(exit_code=0 if status == "success" else 1)
            if status == "failed" and not getattr(self, "_logged_any", False) and run_dir.name.startswith("offline-"):
                shutil.rmtree(run_dir, ignore_errors=True)  # a run that failed before logging anything: nothing to sync
                for name in ("latest-run", "debug.log", "debug-internal.log"):  # wandb's links into that run
                    link = run_dir.parent / name
                    if link.is_symlink() and not link.exists():
                        link.unlink()
                _prune_empty(run_dir.parent)
        except Exception as e:  # noqa: BLE001
            log.warning("could not close the wandb run: %s", e)


def discard_empty_logs(trainer) -> None:
    """After a run failed before its first update: remove each logger's folder that holds nothing but the
    saved config (no metrics beyond a header, no checkpoint), so failed starts leave no empty version_N."""
    if trainer is None or trainer.global_step > 0:
        return
    for lg in trainer.loggers:
        folder = getattr(lg, "log_dir", None)
        if not folder or isinstance(lg, _LightningWandbLogger) or not Path(folder).is_dir():
            continue
        folder = Path(folder)
        metrics = folder / "metrics.csv"
        if {p.name for p in folder.iterdir()} <= {"config.yaml", "hparams.yaml", "metrics.csv"} and (
                not metrics.exists() or len(metrics.read_text().splitlines()) <= 1):
            shutil.rmtree(folder, ignore_errors=True)
            _prune_empty(folder.parent)


def _prune_empty(folder: Path) -> None:
    """`folder` and the folders above it, inside the working folder, while a discarded run left them empty (its
    logger's name folder, `runs/wandb`, `runs/`)."""
    cwd = Path.cwd().resolve()
    folder = folder.resolve()
    while folder != cwd and cwd in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
