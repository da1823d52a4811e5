"""Checkpoint files that survive interruptions and full disks.

`AtomicCheckpointIO` (a Lightning CheckpointIO plugin) writes each checkpoint to a temporary file in
the target's own folder, flushes it to disk and renames it into place, so a save that fails half-way
(a full disk, a kill) leaves the previous checkpoint as it was; Lightning's own save stages the file
in the system temp folder and moves it, which across file systems is a copy that can be cut short.

Each save also writes `NAME.sha256` beside the checkpoint (its sha256 and size), hashed from the bytes as they
are written rather than read back: a save of a few GB then costs one pass over the disk, not two. Loading checks
the file against it first, so bytes damaged anywhere (not only a truncated end, which the unpickler notices) are an
error that names the file, never a resumed run on wrong weights. A link (ModelCheckpoint's `save_last: link`) is
checked against its target's sum. A checkpoint without that file (another tool's) loads unchecked."""
from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rlcu.pypi_files import sha256


class CorruptCheckpointError(ValueError):
    def __init__(self, path, cause: BaseException):
        super().__init__(f"checkpoint {path} is truncated or corrupted ({type(cause).__name__}: {cause}); "
                         "resume from an earlier checkpoint")


class ChecksumMismatch(ValueError):
    pass


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


class UnsafeCheckpointError(ValueError):
    """A checkpoint that only a full unpickling (which can run code) would load."""


def verify(path: str | Path) -> None:
    """Check `path` against the checksum saved with it (if any); a mismatch is a CorruptCheckpointError."""
    path = Path(path).resolve()  # a link's own .sha256 may be left from when the name held a file
    saved = checksum_path(path)
    if not saved.is_file():
        return
    want, _, size = saved.read_text().strip().partition(" ")
    got_size = path.stat().st_size
    if size and int(size) != got_size:
        raise CorruptCheckpointError(path, ChecksumMismatch(f"{got_size} bytes, {size} when saved"))
    if sha256(path) != want:
        raise CorruptCheckpointError(path, ChecksumMismatch(f"its sha256 differs from {saved.name}"))


def load(path: str | Path, map_location: Any = "cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    verify(path)
    try:  # weights only: unpickling anything else can run code; rlcu's and Lightning's checkpoints need no more
        return torch.load(path, map_location=map_location, weights_only=True)
    except PermissionError:
        raise
    except pickle.UnpicklingError as e:
        what = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), None)
        if what is None:  # bytes that are no pickle at all
            raise CorruptCheckpointError(path, e) from None
        raise UnsafeCheckpointError(f"checkpoint {path} holds Python objects beyond tensors and plain values "
                                    f"({what}); rlcu loads checkpoints as weights only, since unpickling objects can "
                                    "run code. If you trust the file, load it with torch.load(weights_only=False) and "
                                    "save what you need") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CorruptCheckpointError(path, e) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp_sum = path.with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                hashed = _HashingWriter(f)
                torch.save(checkpoint, hashed)
                f.flush()
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            digest = hashed.sha.hexdigest() if hashed.size == size else sha256(tmp)  # torch wrote in order
            _write_synced(tmp_sum, f"{digest} {size}\n")
            os.replace(tmp, path)
            os.replace(tmp_sum, checksum_path(path))
        except BaseException:
            tmp.unlink(missing_ok=True)
            tmp_sum.unlink(missing_ok=True)
            raise

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(Path(path)).unlink(missing_ok=True)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        return load(path, map_location if map_location is not None else "cpu")


class _HashingWriter:
    """A file's writes, hashed on their way: torch.save writes a stream without seeking it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
