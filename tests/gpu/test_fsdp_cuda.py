"""fsdp2 on two GPUs (NCCL) against one GPU: the engine decodes the gathered model with CUDA graphs, and
the update matches one process's (run on an H200 pair)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
WORKER = Path(__file__).parents[1] / "integration" / "distributed_worker.py"
ROOT = Path(__file__).parents[2]


def run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RLCU_WORKER_ACCELERATOR="gpu", OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_fsdp2_rollouts_use_decode_graphs_and_update_like_one_gpu(tmp_path):
    folder = tiny_hf_folder(tmp_path / "tiny", "qwen3", vocab_size=64, hidden=128, heads=4, kv_heads=2, head_dim=32)
    run([sys.executable, str(WORKER), str(folder), str(tmp_path / "one.pt"), "auto", "1", "4"], tmp_path)
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29561", str(WORKER),
         str(folder), str(tmp_path / "two.pt"), "fsdp2", "2", "2"], tmp_path)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-4, f"FSDP update on two GPUs differs from one GPU by {worst:.2e} (fp32, tf32 matmuls)"
    assert int((tmp_path / "two.pt.graphs").read_text()) > 0, "the gathered model decoded without CUDA graphs"
