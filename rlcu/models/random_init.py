"""Random weights as transformers initialises a decoder (normal, std 0.02; norms at their identity), for
benchmark shapes and for a model built on the meta device and materialised only as each rank's share."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_weights(model: nn.Module, seed: int | None = None) -> nn.Module:
    """Every parameter of `model` (rlcu's CausalLM) drawn afresh, in place; `seed`: from a generator of its own,
    so that processes that hold the same tensors draw the same values."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    offset = model.config.spec.norm_offset
    for name, p in model.named_parameters():
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):  # the gated norm scales by w, not 1 + w
            p.fill_(1.0)
        elif name.endswith("A_log"):  # decay rates as transformers draws them
            p.copy_(torch.empty_like(p).uniform_(0.01, 16, generator=generator).log())
        elif "norm" in name:
            p.fill_(1.0 - offset)  # Gemma stores w and scales by 1 + w
        else:
            p.normal_(0.0, 0.02, generator=generator)
    return model


def materialize(model: nn.Module, device: torch.device, seed: int = 0) -> nn.Module:
    """A model built on the meta device (no memory), given memory on `device` and random weights."""
    model.to_empty(device=device)
    return init_weights(model, seed)
