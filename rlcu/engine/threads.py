"""Sharing the interpreter with the decode loop. A worker thread that runs Python while the engine decodes (the
rewards scored during generation, the streamer's group scorer) takes the interpreter's lock whenever the decode
loop waits on the GPU, and CPython hands it back only after its switch interval, 5 ms by default: longer than a
decode step of 64 sequences (about 2 ms on the H200). While such a worker runs, the interval is shortened, so
that the loop gets the lock back within a fraction of a step. Episodes' continuations (tools, an agent
endpoint and its programs) run with the default: shortened there, the 64 x 4-turn HTTP episodes on the H200
gained nothing measurable and the in-process ones varied more (docs/benchmarks.md)."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

SWITCH_INTERVAL_S = 2e-4


@contextlib.contextmanager
def beside_decoding() -> Iterator[None]:
    """The switch interval at most SWITCH_INTERVAL_S inside, as it was after."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
