"""Output paths checked before any work, so a long run never ends by failing to write its result."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable_file(path: str | Path, option: str) -> Path:
    """The folder of `path` exists (made if needed) and takes a new file; `option` names the flag in errors."""
    path = Path(path)
    check_writable_folder(path.parent, option, path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path")
    return path


def check_writable_folder(folder: str | Path, option: str, shown: str | Path | None = None,
                          keep: bool = True) -> Path:
    """`keep` False: the folders made for the check are removed after it (a run's output folders, which the run
    makes again as it writes: a run that fails to start leaves none behind)."""
    folder = Path(folder)
    if shown is None and folder.is_file():
        raise ValueError(f"{option} {folder} is a file; give a folder path")
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
    try:
        for attempt in range(3):
            folder.mkdir(parents=True, exist_ok=True)
            try:
                fd, probe = tempfile.mkstemp(dir=folder, prefix=".rlcu-write-check-")
                break
            except FileNotFoundError:  # another run's check removed the folder it made (two starts in one place)
                if attempt == 2:
                    raise
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{option} {shown or folder}: cannot write there ({e.strerror or e}); "
                         "choose a writable path") from None
    finally:
        for path in made if not keep else ():
            try:
                path.rmdir()
            except OSError:
                break  # not made here after all, or not empty: keep it and what is above it
    return folder
