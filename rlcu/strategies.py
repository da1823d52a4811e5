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
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = self.num_processes
        if self._data_parallel_size == "auto":
            self._data_parallel_size = max(1, self.num_nodes * self.num_processes // self._tensor_parallel_size)
        super().setup_environment()

    # ---- tensor parallelism: each rank holds shares, the checkpoint holds whole tensors ----------------------
    def _split_models(self) -> dict[str, nn.Module]:
        """State-dict prefix -> each model in the LightningModule that tensor parallelism split (it carries its
        `tensor_parallel`, whose methods gather and share its tensors: rlcu/models/tensor_parallel.py)."""
        return {f"{name}.": m for name, m in self.lightning_module.named_modules()
                if getattr(m, "tensor_parallel", None) is not None and hasattr(m, "config")}

    def lightning_module_state_dict(self) -> dict:
        models = self._split_models()
        if not models:
            return super().lightning_module_state_dict()
        state = self.lightning_module.state_dict()
        for prefix, m in models.items():  # a collective: every rank assembles, rank 0 saves
            state.update(m.tensor_parallel.full_state_dict(m, prefix, cpu=True))
        return {k: v.detach().cpu() for k, v in state.items()}

    def optimizer_state(self, optimizer) -> dict:
        if not self._split_models():
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self._each_share(optimizer, optimizer.state_dict(), lambda t, style, tp: tp.gather(t, style).cpu())

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        if not self._split_models():
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=self.lightning_module.strict_loading)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            optimizer.load_state_dict(self._each_share(optimizer, state, lambda t, style, tp: tp.share(t, style)))
        return checkpoint

    def _each_share(self, optimizer, state: dict, fn) -> dict:
        """`state` (MasterWeightAdamW's) with fn(tensor, style, group) applied to the moments and master weights of
        every split parameter: whole tensors in the file, shares in the optimizer."""
        styles = {}
        for m in self._split_models().values():
            params = dict(m.named_parameters())
            styles.update({id(params[key]): style for key, style in m.tensor_parallel.split_tensors(m).items()})
        params = optimizer.model_params
        state = dict(state, state={i: dict(moments) for i, moments in state["state"].items()})  # the live ones stay
        for i, p in enumerate(params):
            moments = state["state"].get(i, {})
            for key, value in moments.items():
                if id(p) in styles and torch.is_tensor(value) and value.dim():
                    moments[key] = fn(value, styles[id(p)], p.tensor_parallel)
        copied = [p for p, m in zip(params, optimizer.masters) if m is not p]
        if "masters" in state:
            state["masters"] = [fn(v, styles[id(p)], p.tensor_parallel) if id(p) in styles else v
                                for v, p in zip(state["masters"], copied)]
        return state


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) over all processes, for rlcu")
if "tp" not in StrategyRegistry:
    StrategyRegistry.register("tp", FSDP2Strategy, description="tensor parallelism over the processes of a node, "
                              "for rlcu", tensor_parallel_size="auto")
