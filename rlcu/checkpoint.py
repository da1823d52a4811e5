"""Checkpoint files that survive interruptions and full disks.

`AtomicCheckpointIO` (a Lightning CheckpointIO plugin) writes each checkpoint to a temporary file in
the target's own folder, flushes it to disk and renames it into place, so a save that fails half-way
(a full disk, a kill) leaves the previous checkpoint as it was; Lightning's own save stages the file
in the system temp folder and moves it, which across file systems is a copy that can be cut short.
Loading a truncated or corrupted file is an error that names the file."""
from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class CorruptCheckpointError(ValueError):
    def __init__(self, path, cause: BaseException):
        super().__init__(f"checkpoint {path} is truncated or corrupted ({type(cause).__name__}: {cause}); "
                         "resume from an earlier checkpoint")


def load(path: str | Path, map_location: Any = "cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:  # a Lightning checkpoint holds hyper-parameters beside tensors, so it is not weights-only
        return torch.load(path, map_location=map_location, weights_only=False)
    except PermissionError:
        raise
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CorruptCheckpointError(path, e) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return load(path, map_location if map_location is not None else "cpu")
