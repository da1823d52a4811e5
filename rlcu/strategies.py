"""`fsdp2` and `tp`: Lightning's ModelParallelStrategy set up for rlcu, registered under those names so that
`--trainer.strategy=fsdp2` and `--trainer.strategy=tp` work on the command line.

ModelParallelStrategy's defaults are made for 2-D parallelism (data parallel across nodes, tensor
parallel within one). `fsdp2` shards with FSDP alone, so every process is a data-parallel rank. `tp` splits
each layer's heads and MLP columns across the processes (`rlcu/models/tensor_parallel.py`), on one node.
Either way the checkpoint is one file (assembled on rank 0, in the layout one process has) that `rlcu eval`,
`rlcu export` and `--ckpt_path` read like any other."""
from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn


class FSDP2Strategy(ModelParallelStrategy):
    """`tensor_parallel_size`: processes that split each layer between them ("auto": every process of a node);
    1 (the default): FSDP over all processes."""

    def __init__(self, tensor_parallel_size: int | str = 1, save_distributed_checkpoint: bool = False, **kwargs):
        super().__init__(tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        # the process count is known only here, and ModelParallelStrategy offers no public setter for it;
        # tests/unit/test_cli.py pins the Lightning versions this was tested with
        world = self.num_nodes * self.num_processes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = self.num_processes
        if world % self._tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={self._tensor_parallel_size} does not divide the {world} processes "
                             f"({self.num_nodes} node(s) x {self.num_processes} device(s)): make trainer.devices x "
                             "trainer.num_nodes a multiple of it")
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world // self._tensor_parallel_size
        super().setup_environment()

    # ---- tensor parallelism: each rank holds shares, the checkpoint holds whole tensors ----------------------
    def _split_models(self) -> dict[str, nn.Module]:
        """State-dict prefix -> each model in the LightningModule that tensor parallelism split (it carries its
        `tensor_parallel`, whose methods gather and share its tensors: rlcu/models/tensor_parallel.py)."""
        return {f"{name}.": m for name, m in self.lightning_module.named_modules()
                if getattr(m, "tensor_parallel", None) is not None and hasattr(m, "config")}

    def _splits(self) -> dict[str, tuple]:
        """State-dict key -> (how it is split, its group) of every share in the LightningModule."""
        out = {}
        for prefix, m in self._split_models().items():
            tp = m.tensor_parallel
            out.update({prefix + key: (style, tp) for key, style in tp.split_tensors(m).items()})
        return out

    def lightning_module_state_dict(self) -> dict:
        if not self._split_models():
            return super().lightning_module_state_dict()
        splits = self._splits()
        # in one order on every rank: each tensor is a collective (FSDP's gather, then the group's)
        return {k: _whole(v, splits.get(k)) for k, v in self.lightning_module.state_dict().items()}

    def optimizer_state(self, optimizer) -> dict:
        if not self._split_models():
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self._each_tensor(optimizer, optimizer.state_dict(), lambda v, p, split: _whole(v, split))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        if not self._split_models():
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        module, splits, saved = self.lightning_module, self._splits(), checkpoint["state_dict"]
        live = module.state_dict()
        state = {k: _share(v, live[k], splits.get(k)) if k in live else v for k, v in saved.items()}
        module.load_state_dict(state, strict=module.strict_loading)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            optimizer.load_state_dict(self._each_tensor(optimizer, state, _share))
        return checkpoint

    def _each_tensor(self, optimizer, state: dict, fn) -> dict:
        """`state` (MasterWeightAdamW's) with fn(tensor, parameter, split) applied to each parameter's moments and
        master weight: whole tensors in the file, this rank's shares (and FSDP shards) in the optimizer."""
        splits = self._splits()
        names = {id(p): k for k, p in self.lightning_module.named_parameters()}
        params = optimizer.model_params
        state = dict(state, state={i: dict(moments) for i, moments in state["state"].items()})  # the live ones stay
        for i, p in enumerate(params):
            moments = state["state"].get(i, {})
            for key, value in moments.items():
                if torch.is_tensor(value) and value.dim():
                    moments[key] = fn(value, p, splits.get(names.get(id(p))))
        copied = [p for p, m in zip(params, optimizer.masters) if m is not p]
        if "masters" in state:
            state["masters"] = [fn(v, p, splits.get(names.get(id(p)))) for v, p in zip(state["masters"], copied)]
        return state


def _whole(value: torch.Tensor, split: tuple | None) -> torch.Tensor:
    """A tensor as one process holds it: FSDP's shard gathered over the data-parallel ranks, then a tensor-parallel
    share over its group; in host memory."""
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    if split is not None:
        value = split[1].gather(value, split[0])
    return value.detach().cpu()


def _share(whole: torch.Tensor, like: torch.Tensor, split: tuple | None) -> torch.Tensor:
    """This rank's part of a whole tensor from a checkpoint, placed as `like` (a parameter, or an FSDP shard of one)."""
    if split is not None:
        whole = split[1].share(whole, split[0])
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = like.to_local()
        return distribute_tensor(whole.to(local.device), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return whole


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) over all processes, for rlcu")
if "tp" not in StrategyRegistry:
    StrategyRegistry.register("tp", FSDP2Strategy, description="tensor parallelism over the processes of a node, "
                              "for rlcu", tensor_parallel_size="auto")
