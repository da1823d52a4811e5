"""`fsdp2`: Lightning's ModelParallelStrategy set up for rlcu, registered under that name so that
`--trainer.strategy=fsdp2` works on the command line.

ModelParallelStrategy's defaults are made for 2-D parallelism (data parallel across nodes, tensor
parallel within one); rlcu shards with FSDP alone, so every process is a data-parallel rank, and the
checkpoint is one file (assembled on rank 0) that `rlcu eval`, `rlcu export` and `--ckpt_path` read
like any other."""
from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs):
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        # the process count is known only here, and ModelParallelStrategy offers no public setter for it;
        # tests/unit/test_cli.py pins the Lightning versions this was tested with
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes  # every process: one FSDP rank
        super().setup_environment()


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) over all processes, for rlcu")
