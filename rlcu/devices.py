"""The device a command runs on, checked before any work: a name torch does not know, or a GPU this machine lacks,
is a one-line error naming the devices there are."""
from __future__ import annotations

import torch

KINDS = ("cpu", "cuda")


def resolve_device(name: str, option: str = "--device") -> str:
    """'auto' -> 'cuda' where torch sees a GPU, else 'cpu'; 'cpu', 'cuda' and 'cuda:N' as given, once checked."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in KINDS:
        raise ValueError(f"{option} {name!r} is not a device rlcu runs on; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"{option} {name}: torch sees no CUDA device on this machine (torch {torch.__version__}); "
                             "use cpu or auto")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{option} {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return name
