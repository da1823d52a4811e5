"""GGUF files as Hugging Face folders: dequantised once through transformers' GGUF reader and cached, so
that every later load is the ordinary folder path."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlcu.models.spec import family
from rlcu.pypi_files import cache_dir

log = logging.getLogger(__name__)


def gguf_to_folder(gguf: Path, out: Path | None = None) -> Path:
    """Dequantise a GGUF file into an HF folder once (transformers' GGUF reader), cached by file identity."""
    if out is None:
        st = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").exists():
        name_architecture(out)  # folders converted before rlcu wrote it
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder at %s (once)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of this process's own: several processes (DDP ranks on a fresh machine) may convert at once
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.partial-"))
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded transformers model refuses save_pretrained, so write its config and weights directly.
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]  # a GGUF-loaded config has none; TRL and vLLM need it
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    return publish_folder(tmp, out)


def publish_folder(tmp: Path, out: Path) -> Path:
    """Move a finished conversion into place in one rename, so a half-written folder is never mistaken for
    a finished one; where another process got there first, keep its folder and drop ours."""
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
    return out


def name_architecture(folder: Path) -> None:
    """Caches converted before the conversion wrote `architectures` get it now."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if not config.get("architectures"):
        config["architectures"] = [family(config["model_type"]).architecture]
        path.write_text(json.dumps(config, indent=2))
