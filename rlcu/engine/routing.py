"""Which experts each MoE layer picked for each token, kept in the pool slot by slot as its keys and values
are: a rollout hands each completion's routing to the trainer, which counts the tokens its own forward routes
elsewhere (`moe/routing_mismatch`). The writes are part of the forward, so a CUDA graph replays them."""
from __future__ import annotations

import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


def bytes_per_token(cfg) -> int:
    """The routing record's bytes per pool slot (0 for a dense model)."""
    if not cfg.is_moe:
        return 0
    size = torch.empty((), dtype=routing_dtype(cfg.num_experts)).element_size()
    return len(cfg.moe_layers) * cfg.num_experts_per_tok * size


class RoutingCache:
    def __init__(self, cfg, num_slots: int, device: torch.device):
        # one row past the pool's slots takes the writes of a CUDA graph's padding rows (slot -1)
        self.table = torch.zeros(len(cfg.moe_layers), num_slots + 1, cfg.num_experts_per_tok,
                                 dtype=routing_dtype(cfg.num_experts), device=device)
        self.scratch = num_slots

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """A step's pool slots [T] (-1: a padding row) -> the table rows its writes go to."""
        return torch.where(slots >= 0, slots, self.scratch)

    def write(self, moe_index: int, rows: torch.Tensor, experts: torch.Tensor) -> None:
        self.table[moe_index].index_copy_(0, rows, experts.to(self.table.dtype))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """A fork's copy of a shared partial block takes the block's routing with its keys and values."""
        offsets = torch.arange(block_size, device=src.device)
        table = self.table
        table[:, (dst[:, None] * block_size + offsets).reshape(-1)] = table[:, (src[:, None] * block_size
                                                                                 + offsets).reshape(-1)]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, moe layers, k] int16 of the tokens in these slots."""
        return self.table[:, slots].transpose(0, 1).to(torch.int16)
