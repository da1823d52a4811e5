"""Triton is optional on CPU machines (the PyTorch references run there); kernels are defined only
when it imports."""
import functools

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton, tl, HAS_TRITON = None, None, False


def use_triton(t) -> bool:
    """Triton on CUDA tensors; RLCU_TRITON=1 forces it elsewhere (the CPU interpreter, for tests)."""
    import os

    return HAS_TRITON and (t.is_cuda or os.environ.get("RLCU_TRITON") == "1")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _cuda_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device=None, cpu: int = 132) -> int:
    """Streaming multiprocessors of a CUDA device (None: the current one); `cpu` where there is no CUDA
    device (the interpreter then plans its grids as for an H100/H200-sized GPU, 132, by default)."""
    import torch

    if device is not None and torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return cpu
    index = torch.device(device).index if device is not None else None
    return _cuda_sms(torch.cuda.current_device() if index is None else index)
