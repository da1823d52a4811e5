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
    check_extents(gguf)
    log.info("converting %s to a Hugging Face folder at %s (once)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of this process's own: several processes (DDP ranks on a fresh machine) may convert at once
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.partial-"))
    try:
        return publish_folder(_convert(gguf, tmp), out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert(gguf: Path, tmp: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                    ignore_mismatched_sizes=True, output_loading_info=True)
    wrong = sorted(f"{k} {tuple(theirs)} (its metadata wants {tuple(ours)})" for k, theirs, ours in
                   info["mismatched_keys"]) + sorted(f"{k} (missing)" for k in info["missing_keys"])
    if wrong:  # transformers re-initialised these at random; a model of them would train on noise
        raise ValueError(f"{gguf}: tensor {wrong[0]} does not fit the file's metadata" +
                         (f", and {len(wrong) - 1} more" if len(wrong) > 1 else ""))
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
    return tmp


def check_extents(path: Path) -> None:
    """Raise, naming the first tensor whose bytes lie past the end of the file (a truncated download), before
    the GGUF reader fails on it with a reshape error that names nothing."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Extents(GGUFReader):  # the header as the reader parses it; the tensors' bytes are only measured
        def _build_tensors(self, start: int, fields) -> None:
            for field in fields:
                _, name, _, dims, dtype, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(dtype[0]))]
                end = start + int(offset[0]) + int(np.prod(dims)) // block * type_size
                if end > len(self.data):
                    raise ValueError(f"{path}: tensor {bytes(name).decode(errors='replace')!r} ends at byte {end} "
                                     f"of a file of {len(self.data)}; the file is truncated: download it again")

    try:
        Extents(path)
    except (ValueError, IndexError, KeyError) as e:
        raise ValueError(str(e) if str(e).startswith(str(path)) else f"{path} is not a readable GGUF file ({e})") \
            from None


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
