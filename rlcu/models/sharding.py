"""FSDP (PyTorch's `fully_shard`, which Lightning's ModelParallelStrategy drives) for rlcu's models.

Training keeps each rank's shard of fp32 parameters (they are the master weights: the optimizer
steps them directly) and all-gathers one decoder layer at a time in the compute dtype. A rollout
needs every layer at every decode step, so `full_parameters` gathers them all once for the whole
rollout (and sets FSDP's per-layer hooks aside while it lasts) and reshards after: during generation
each rank holds the whole model in the compute dtype,
as under DDP; during training it holds 1/N of the parameters, gradients and optimizer state."""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import torch
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model: nn.Module, mesh, compute_dtype: torch.dtype) -> nn.Module:
    """Shard every decoder layer, then the rest (embeddings, final norm, LM head) as the root group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.float()  # the shards are the fp32 master weights
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def _groups(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_parameters(model: nn.Module, times: dict[str, float] | None = None, clock=time.perf_counter):
    """Inside: every parameter of a sharded `model` is a plain, whole tensor in the compute dtype (so
    the engine reads them in place, and its CUDA graphs capture them); outside: sharded again. A no-op
    for a model that is not sharded. `times` receives the seconds of the "gather" and the "reshard" by
    `clock` (on CUDA, one that waits for the device: the gather is asynchronous there)."""
    if not is_sharded(model):
        yield model
        return
    start = clock()
    groups = _groups(model)
    for g in groups:
        g.set_reshard_after_forward(False, recurse=False)  # no re-gather at each decode step
        g.unshard()
    # With everything gathered, FSDP's forward hooks have nothing left to do but cost: at every decode
    # step they ran in every layer (a rollout was 9x slower than under DDP). Set aside, the model runs
    # as a plain module until the rollout ends.
    hooks = [(g, g._forward_pre_hooks, g._forward_hooks) for g in groups]
    for g in groups:
        g._forward_pre_hooks, g._forward_hooks = OrderedDict(), OrderedDict()
    if times is not None:
        times["gather"] = clock() - start
    try:
        yield model
    finally:
        start = clock()
        for g, pre, post in hooks:
            g._forward_pre_hooks, g._forward_hooks = pre, post
        for g in groups:
            g.reshard()
            # the root stays gathered between forward and backward
            g.set_reshard_after_forward(g is not model, recurse=False)
        if times is not None:
            times["reshard"] = clock() - start

