"""The built-in decoder families, one small spec each (`rlcu/models/spec.py`). Importing this package
registers them; a model_type that none claims runs on the transformers fallback (`rlcu/models/hf.py`)."""
from rlcu.models.families import (  # noqa: F401
    gemma,
    gpt_oss,
    granite,
    llama,
    mistral,
    olmo,
    olmoe,
    phi,
    qwen,
    qwen3_5,
    seed_oss,
    smollm,
)
