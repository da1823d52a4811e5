"""Triton is optional on CPU machines (the PyTorch references run there); kernels are defined only
when it imports."""
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
