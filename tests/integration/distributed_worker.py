"""One rank of the FSDP test (started by torchrun, which Lightning's TorchElasticEnvironment detects):
a few GRPO steps on a tiny model, rollouts by the native engine on the gathered parameters; rank 0
saves the final weights. Usage: distributed_worker.py MODEL_FOLDER OUT_FILE STRATEGY DEVICES BATCH_SIZE [NUM_NODES];
MODEL_FOLDER may be several folders joined by commas: each trains in turn in the same processes, and rank 0 saves
OUT_FILE.NAME for each (NAME the folder's name). RLCU_WORKER_STEPS: the steps (2 unless set);
RLCU_WORKER_STOP_AT: a step to stop at (of the RLCU_WORKER_STEPS the run is set for), with a checkpoint in
OUT_FILE.dir/stopped.ckpt; RLCU_WORKER_RESUME: a checkpoint to resume from.
RLCU_WORKER_ACCELERATOR=gpu runs it on GPUs (tests/gpu); rank 0 then also writes OUT_FILE.graphs, the
number of decode steps replayed from CUDA graphs."""
import faulthandler
import os
import sys
from dataclasses import replace

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlcu.data.module import PromptDataModule
from rlcu.grpo.module import GRPOModule
from rlcu.rollout.base import Capabilities, RolloutBatch
from rlcu.rollout.native import NativeRollout
from tests.helpers import toy_rows
from tests.integration.test_resume import StopAt

STEPS, G = 2, 4


class PromptSeeded(NativeRollout):
    """The engine, one group at a time, seeded by the prompt: completions depend on the weights and the
    prompt alone, not on the rank or the batch, so one process and two ranks sample the same tokens."""

    capabilities = Capabilities(lora=True, native_models_only=True)  # generate() takes neither hook

    def generate(self, prompt_token_ids, sampling):
        groups = [prompt_token_ids[i:i + G] for i in range(0, len(prompt_token_ids), G)]
        parts = []
        for group in groups:
            parts.append(super().generate(group, replace(sampling, seed=sum(group[0]) * 7919 + len(group[0]))))
            graphs = self.engine.runner.graphs
            self.graph_captures = getattr(self, "graph_captures", 0) + (len(graphs.graphs) if graphs else 0)
        return RolloutBatch(*(sum((getattr(p, f) for p in parts), []) for f in
                              ("prompt_ids", "completion_ids", "logprobs", "finish_reasons")))


def token_value(prompts, completions, completion_ids, **kwargs):
    return [sum(ids) / (8 * len(ids)) for ids in completion_ids]


def main(folder, out, strategy, devices, batch_size, num_nodes=1):
    torch.manual_seed(0)
    low_mem = os.environ.get("RLCU_WORKER_LOW_CPU_MEM") == "1"
    module = GRPOModule(folder, rewards=[token_value], rollout=PromptSeeded(), num_generations=G,
                        max_completion_length=4, learning_rate=1e-2, micro_batch_size=4, low_cpu_mem_usage=low_mem)
    assert (module.policy.device.type == "meta") == low_mem  # low_cpu_mem_usage: no weights before configure_model
    data = PromptDataModule(toy_rows(16, seed=3), batch_size=batch_size, seed=1)
    accelerator = os.environ.get("RLCU_WORKER_ACCELERATOR", "cpu")
    steps, resume = int(os.environ.get("RLCU_WORKER_STEPS", STEPS)), os.environ.get("RLCU_WORKER_RESUME")
    stop = os.environ.get("RLCU_WORKER_STOP_AT")
    callbacks = [] if stop is None else [StopAt(int(stop)), ModelCheckpoint(out + ".dir", "stopped",
                                                                            every_n_train_steps=1)]
    if strategy == "tp2-fsdp":  # 2-way tensor parallel groups, FSDP across them
        from rlcu.strategies import FSDP2Strategy

        strategy = FSDP2Strategy(tensor_parallel_size=2)
    trainer = L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                        max_steps=steps, logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data, ckpt_path=resume)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if strategy == "fsdp2":
        state = get_model_state_dict(module.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif not isinstance(strategy, str) or strategy == "tp":  # a collective: every rank assembles the shares
        state = {k[len("policy."):]: v for k, v in trainer.strategy.lightning_module_state_dict().items()
                 if k.startswith("policy.")}
    else:
        state = module.policy.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out)
        if accelerator == "gpu":
            with open(out + ".graphs", "w") as f:
                f.write(str(module.rollout.graph_captures))
    trainer.save_checkpoint(out + ".ckpt")  # a collective under FSDP: every rank calls it


if __name__ == "__main__":
    faulthandler.enable()  # a rank that dies in C++ prints every thread's Python stack
    folders = sys.argv[1].split(",")
    for folder in folders:
        out = sys.argv[2] if len(folders) == 1 else f"{sys.argv[2]}.{os.path.basename(folder)}"
        main(folder, out, sys.argv[3], *map(int, sys.argv[4:]))
    from rlcu.cli import close_process_group

    close_process_group()  # as `rlcu run` does
    # Everything is saved. A rank that finished its work has still aborted in the interpreter's teardown now and
    # then (`terminate called without an active exception`, in gloo's threads, also after the group was destroyed),
    # which is torch's, not what this test checks: the worker ends without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
