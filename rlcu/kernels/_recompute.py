"""Whether the forward now running is activation checkpointing's recompute, whose values feed only the backward.

Batch-invariant ops (exact logprobs, docs/engine.md) owe their bits to the forward whose values the loss reads. A
checkpointed layer's recompute gives the backward its saved tensors, the point the gradients are taken at, and
nothing the loss reads: there those ops compute with the fast kernels instead, saving the same tensors, so the
recomputed graph has the first forward's structure (what `torch.utils.checkpoint` matches it by)."""
from __future__ import annotations

import contextlib
import contextvars

_RECOMPUTING = contextvars.ContextVar("rlcu_recomputing", default=False)


def recomputing() -> bool:
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recompute():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def recompute_contexts():
    """`context_fn` of `torch.utils.checkpoint.checkpoint`: the forward as it is, its recompute under `recompute()`.
    Only for a function whose tensors' shapes never depend on its values (not an MoE layer, whose routing could
    then differ from the first forward's)."""
    return contextlib.nullcontext(), recompute()
