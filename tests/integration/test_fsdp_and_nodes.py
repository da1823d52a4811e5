"""FSDP (`--trainer.strategy=fsdp2`) and several nodes, each against one process on the same global
batch. The ranks are started by torchrun, as a cluster would start them (Lightning's
TorchElasticEnvironment picks them up); rollouts come from the native engine on the gathered
parameters, seeded by the prompt so that every layout samples the same tokens. Tolerance: 1e-5
(float32; all-reduce and reduce-scatter order; the update itself moves weights by 2e-2)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FALLBACK_FAMILIES, FAMILIES, tiny_hf_folder

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def run(args, cwd, timeout=300, **env):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=300):
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny model and one process's weights after the steps (batch of 4 prompts)."""
    tmp = tmp_path_factory.mktemp("dist")
    folder = tiny_hf_folder(tmp / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    finish([run([sys.executable, str(WORKER), str(folder), str(tmp / "one.pt"), "auto", "1", "4"], tmp)])
    from rlcu.models import load_model

    initial = load_model(folder)[0].state_dict()
    one = torch.load(tmp / "one.pt")
    assert max((one[k] - initial[k]).abs().max().item() for k in one) > 1e-3, "too small an update to compare"
    return tmp, folder, one


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_fsdp_two_ranks_update_like_one_process_and_export(reference):
    tmp, folder, one = reference
    finish([run(torchrun("--nproc-per-node=2", "--master-port=29541", str(WORKER), str(folder), str(tmp / "fsdp.pt"),
                         "fsdp2", "2", "2"), tmp)])
    two = torch.load(tmp / "fsdp.pt")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, f"FSDP update differs from one process by {worst:.2e}"
    # the checkpoint is one file that rlcu export turns into an HF folder with the trained weights
    from rlcu.export import export
    from rlcu.models import load_model

    exported, _ = load_model(export(tmp / "fsdp.pt.ckpt", tmp / "hf"))
    state = exported.state_dict()
    assert max((state[k] - two[k]).abs().max().item() for k in two) == 0


# (strategy, processes, rows per data-parallel rank): `--trainer.strategy=tp` on 2 processes, one data-parallel group
# that trains on the whole batch (also with low_cpu_mem_usage: each rank reads its shares, one rank after the other);
# FSDP2Strategy(tensor_parallel_size=2) on 4, FSDP across two such groups
TP_LAYOUTS = {"tp2": ("tp", "2", "4"), "tp2-fsdp2": ("tp2-fsdp", "4", "2"), "tp2-low-mem": ("tp", "2", "4")}
PORTS = {"tp2": 29544, "tp2-fsdp2": 29546, "tp2-low-mem": 29548}  # a port for each test that may run beside another


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_tensor_parallel_ranks_update_like_one_process_and_export(reference, layout):
    """Each rank of a tensor-parallel group holds half of every layer's heads and MLP columns; the checkpoint holds
    the whole tensors."""
    tmp, folder, one = reference
    strategy, procs, rows = TP_LAYOUTS[layout]
    finish([run(torchrun(f"--nproc-per-node={procs}", f"--master-port={PORTS[layout]}", str(WORKER), str(folder),
                         str(tmp / f"{layout}.pt"), strategy, procs, rows), tmp,
                RLCU_WORKER_LOW_CPU_MEM="1" if layout.endswith("low-mem") else "0")])
    two = torch.load(tmp / f"{layout}.pt")
    assert set(two) == set(one)
    from rlcu.models import load_model

    # the forward sums in another order (two partial sums per projection), and AdamW's first steps move a weight
    # by about lr however small its gradient, so single weights differ by up to 2e-5 (measured); each tensor's
    # update as a whole agrees to 1e-3 of its size (measured: 2e-5 at most), where a wrong reduction moves all of it
    initial = load_model(folder)[0].state_dict()
    for k in one:
        update = (one[k] - initial[k]).norm()
        assert update > 0 and (one[k] - two[k]).norm() <= 1e-3 * update, f"{k} differs under tensor parallelism"
    from rlcu.export import export

    exported = load_model(export(tmp / f"{layout}.pt.ckpt", tmp / f"hf-{layout}"))[0].state_dict()
    assert all(torch.equal(exported[k], two[k]) for k in two)


@pytest.mark.parametrize("layout", ["tp2", "tp2-fsdp2"])
def test_a_tensor_parallel_run_resumes_like_an_unbroken_one(reference, layout):
    """The checkpoint holds whole weights and whole AdamW moments; resumed, each rank takes its share (and FSDP
    shard) again, and the third step lands where a run of 3 steps does."""
    tmp, folder, _ = reference
    strategy, procs, rows = TP_LAYOUTS[layout]
    tp = (f"--nproc-per-node={procs}", f"--master-port={PORTS[layout] + 1}")
    finish([run(torchrun(*tp, str(WORKER), str(folder), str(tmp / f"{layout}-3.pt"), strategy, procs, rows), tmp,
                RLCU_WORKER_STEPS="3")])
    finish([run(torchrun(*tp, str(WORKER), str(folder), str(tmp / f"{layout}-2.pt"), strategy, procs, rows), tmp,
                RLCU_WORKER_STEPS="3", RLCU_WORKER_STOP_AT="2")])
    finish([run(torchrun(*tp, str(WORKER), str(folder), str(tmp / f"{layout}-resumed.pt"), strategy, procs, rows),
                tmp, RLCU_WORKER_STEPS="3", RLCU_WORKER_RESUME=str(tmp / f"{layout}-2.pt.dir" / "stopped.ckpt"))])
    unbroken, resumed, two = (torch.load(tmp / f"{layout}-{n}.pt") for n in ("3", "resumed", "2"))
    assert max((unbroken[k] - two[k]).abs().max().item() for k in two) > 1e-3  # the third step moved the weights
    assert all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)


# one model of each native model_type (the variants are the same layers); not qwen2 and qwen3_5_moe_text, whose
# model types transformers gives their own tokenizer classes, which read the tiny word-level tokenizer's prompts as
# no tokens (their layers are llama's, qwen3_moe's and qwen3_next's)
FSDP_FAMILIES = [f for f in FAMILIES if f not in FALLBACK_FAMILIES and "-" not in f
                 and f not in ("qwen2", "qwen3_5_moe_text")]


def test_fsdp2_trains_every_native_family_like_one_process_and_exports(tmp_path):
    """Each family a few steps under fsdp2 on two ranks (all in the same two processes) against one process. AdamW's
    first steps move a weight by about lr whatever its gradient's size, so where a gradient is near zero its rounding
    moves single weights by up to 1e-3: each tensor's update is compared as a whole, to 1% of its size; a wrong
    reduction of one tensor moves all of it."""
    from rlcu.export import export
    from rlcu.models import load_model

    folders = ",".join(str(tiny_hf_folder(tmp_path / f, f)) for f in FSDP_FAMILIES)
    finish([run([sys.executable, str(WORKER), folders, str(tmp_path / "one.pt"), "auto", "1", "4"], tmp_path),
            run(torchrun("--nproc-per-node=2", "--master-port=29543", str(WORKER), folders, str(tmp_path / "two.pt"),
                         "fsdp2", "2", "2"), tmp_path)], timeout=900)
    for f in FSDP_FAMILIES:
        initial = load_model(tmp_path / f)[0].state_dict()
        one, two = torch.load(tmp_path / f"one.pt.{f}"), torch.load(tmp_path / f"two.pt.{f}")
        assert set(one) == set(two) == set(initial), f
        for k in one:
            update = (one[k] - initial[k]).norm()
            assert update > 0 and (one[k] - two[k]).norm() <= 1e-2 * update, f"{f}: {k} differs under fsdp2"
        exported = load_model(export(tmp_path / f"two.pt.{f}.ckpt", tmp_path / f"hf-{f}"))[0].state_dict()
        assert all(torch.equal(exported[k], two[k]) for k in two), f"{f}: the exported folder differs"


def test_two_nodes_through_torchrun_update_like_one_process(reference):
    """`--trainer.num_nodes=2`: two torchrun agents (one per node, here both on localhost) of one process each."""
    tmp, folder, one = reference
    nodes = [run(torchrun("--nnodes=2", f"--node-rank={r}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                          "--master-port=29542", str(WORKER), str(folder), str(tmp / "nodes.pt"), "ddp", "1", "2", "2"),
                 tmp) for r in (0, 1)]
    finish(nodes)
    two = torch.load(tmp / "nodes.pt")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, f"two nodes' update differs from one process by {worst:.2e}"


@pytest.mark.parametrize("strategy", ["fsdp2", "tp"])
def test_bench_step_on_two_processes(tmp_path, strategy):
    """`rlcu bench step --devices 2 --strategy fsdp2|tp`: Lightning starts rank 1 by re-running the command; rank 0
    prints the one JSON line, under fsdp2 with the gather and reshard around each rollout timed."""
    folder = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    cmd = [sys.executable, "-m", "rlcu.cli", "bench", "step", "--model", str(folder), "--device", "cpu", "--dtype",
           "float32", "--prompts", "4", "--generations", "2", "--prompt_len", "4", "--new_tokens", "5", "--steps", "2",
           "--micro_batch_size", "2", "--devices", "2", "--strategy", strategy, "--adam_state_dtype", "bfloat16"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # rank 1 prints nothing
    import json

    out = json.loads(lines[0])
    assert out["devices"] == 2 and out["strategy"] == strategy and out["adam_state_dtype"] == "bfloat16"
    gathered = {"gather", "reshard"} if strategy == "fsdp2" else set()
    assert set(out["steady"]) == {"total", "generate", "score", "train", "idle"} | gathered
    assert "rank 1 step 1" in done.stderr
