"""Recurrent state beside the paged KV cache, for hybrids' linear-attention layers (Qwen3.5, Qwen3-Next).

A linear-attention layer keeps, per sequence, the short convolution's last inputs and the delta rule's matrix per
value head: a fixed size, whatever the sequence's length. A sequence takes a slot when the scheduler admits it
(one for each request of a rollout; a stream's, one for each sequence in flight, recycled as they end) and keeps
it for its whole life: across prefill chunks, while parked between turns, and when forked (the fork copies its
parent's slot into its own, so that a shared prompt is prefilled once). A
sequence whose blocks were taken back (preemption, a reclaimed parked episode) restarts from zero state at its
first token, as its KV does."""
from __future__ import annotations

import torch

from rlcu.models.config import ModelConfig
from rlcu.models.decoder import CausalLM
from rlcu.models.linear_attention import Segments

# EngineConfig.mamba_ssm_cache_dtype, vLLM's name and values for these states: the delta rule's matrices in the pool.
# "float32" (rlcu's default, the trainer's precision); "bfloat16" or "float16" halve a decode step's largest traffic,
# each step's new state rounded once; "auto": the forward's dtype, as vLLM's "auto"
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}


def state_dtype(model: CausalLM, mamba_ssm_cache_dtype: str = "float32") -> torch.dtype:
    """The dtype the pool keeps the delta rule's matrices in."""
    return STATE_DTYPES[mamba_ssm_cache_dtype] or model.compute_dtype()


def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, matrix_dtype: torch.dtype = torch.float32) -> int:
    """One sequence's state over all linear-attention layers: the convolution window in the forward's dtype, the
    delta rule's matrices in `matrix_dtype`."""
    conv = cfg.linear_conv_channels * (cfg.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
    matrix = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
              * torch.empty((), dtype=matrix_dtype).element_size())
    return len(cfg.linear_layers) * (conv + matrix)


class StatePool:
    """`num_slots` slots, and one more (`scratch`) that the padding rows of a CUDA-graph batch update. The
    convolutions' windows in the forward's `dtype`, the delta rule's matrices in `matrix_dtype` (`state_dtype`)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                 matrix_dtype: torch.dtype = torch.float32):
        self.index = {layer: i for i, layer in enumerate(cfg.linear_layers)}
        n = len(cfg.linear_layers)
        self.scratch = num_slots
        num_slots += 1
        self.conv = torch.zeros(n, num_slots, cfg.linear_conv_channels, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                                device=device)
        self.matrix = torch.zeros(n, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, dtype=matrix_dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.scratch

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.matrix.nbytes

    def read(self, layer_idx: int, cu: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None,
             decode: bool) -> Segments:
        """The states of the sequences at `slots` before this step; `fresh` [N] (bool, or None: none is): those
        starting at their first token, from zeros whatever their slot holds. A decode step's states (windows and
        matrices) stay in the pool, which the layer updates in place."""
        i = self.index[layer_idx]
        if decode and fresh is None:
            return Segments(cu, decode=True, pool=self.matrix[i], conv_pool=self.conv[i], slots=slots)
        conv, matrix = self.conv[i][slots], self.matrix[i][slots]
        if fresh is not None:
            conv = conv.masked_fill(fresh[:, None, None], 0)
            matrix = matrix.masked_fill(fresh[:, None, None, None], 0)
        return Segments(cu, conv, matrix, decode=decode)

    def write(self, layer_idx: int, slots: torch.Tensor, conv: torch.Tensor | None,
              matrix: torch.Tensor | None) -> None:
        i = self.index[layer_idx]
        if conv is not None:  # None: updated in place already
            self.conv[i].index_copy_(0, slots, conv.to(self.conv.dtype))
        if matrix is not None:
            self.matrix[i].index_copy_(0, slots, matrix.to(self.matrix.dtype))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(source slot, destination slot): forks take their parent's state."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.conv.device)
            dst = torch.tensor([d for _, d in pairs], device=self.conv.device)
            self.conv[:, dst] = self.conv[:, src]
            self.matrix[:, dst] = self.matrix[:, src]
