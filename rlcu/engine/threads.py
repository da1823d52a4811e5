"""Sharing the interpreter with the decode loop. Work that runs Python in other threads while the engine decodes
(episodes' continuations, an agent endpoint and its programs, rewards scored during generation) takes the
interpreter's lock whenever the decode loop waits on the GPU, and CPython hands it back only after its switch
interval, 5 ms by default: longer than a decode step of 64 sequences (about 2 ms on the H200). While such work
runs, the interval is shortened, so that the loop gets the lock back within a fraction of a step."""
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
