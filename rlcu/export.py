"""`rlcu export CKPT DIR [--merge]`: the policy of a Lightning checkpoint as a Hugging Face folder
(safetensors, config.json, tokenizer) that transformers and vLLM load; for a LoRA run, its adapters in
PEFT's format (`PeftModel.from_pretrained`), or with --merge folded into a full HF folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def export(checkpoint: str | Path, out: str | Path, merge: bool = False, overwrite: bool = False) -> Path:
    """A LoRA run's checkpoint exports its adapters in PEFT's format, or with `merge` a merged HF folder. A folder
    that holds files already is refused unless `overwrite`; the files are readable by others (0644 less the
    umask), as transformers' own save_pretrained writes them."""
    from rlcu.checkpoint import load
    from rlcu.models.loading import load_model, save_pretrained
    from rlcu.models.lora import add_lora, merge_lora, save_adapter
    from rlcu.paths import check_writable_folder

    checkpoint = Path(checkpoint)
    if not overwrite and Path(out).is_dir() and any(Path(out).iterdir()):
        raise FileExistsError(f"export folder {out} is not empty; choose another folder, or pass --overwrite")
    check_writable_folder(out, "export folder")  # before the checkpoint and the model load, not after
    state = load(checkpoint)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{checkpoint} is not a Lightning checkpoint (no state_dict)")
    hp = state.get("hyper_parameters", {})
    source = hp.get("model")
    if not isinstance(source, str):
        raise ValueError(f"{checkpoint} does not record where its model came from (the module was built around a "
                         "model object); save it with rlcu.models.save_pretrained(module.policy, tokenizer, DIR)")
    model, tokenizer = load_model(source, dtype=hp.get("dtype", "float32"))
    lora = hp.get("peft_config")
    if lora is not None:
        add_lora(model, lora)
    policy = {k.removeprefix("policy."): v for k, v in state["state_dict"].items() if k.startswith("policy.")}
    missing, unexpected = model.load_state_dict(policy, strict=False)
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]:
        raise ValueError(f"{checkpoint}'s policy does not fit {source}: missing {missing}, unexpected {unexpected}")
    if lora is not None and not merge:
        folder = save_adapter(model, out, base_model_name_or_path=source)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    else:
        if lora is not None:
            merge_lora(model)
        folder = save_pretrained(model, tokenizer, out)
    umask = os.umask(0)
    os.umask(umask)
    for file in Path(folder).rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~umask)
    print(f"rlcu export: {checkpoint} (step {state.get('global_step', '?')}) -> {folder}", file=sys.stderr)
    return folder


def run(argv: list[str]) -> Path:
    import argparse

    p = argparse.ArgumentParser(prog="rlcu export", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("checkpoint", help="a Lightning .ckpt written by rlcu run / rlcu fit")
    p.add_argument("out", help="folder to write")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: fold the adapters into the weights (an HF folder) "
                        "instead of PEFT's adapter format")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that holds files already")
    args = p.parse_args(argv)
    return export(args.checkpoint, args.out, merge=args.merge, overwrite=args.overwrite)
