"""Checkpoint files: a failed save (a full disk) leaves the previous checkpoint intact, and a truncated
file is an error that names it."""
import errno

import pytest
import torch

from rlcu import cli
from rlcu.checkpoint import AtomicCheckpointIO, CorruptCheckpointError, load


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.arange(1000)}, path)
    before = path.read_bytes()
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        io.save_checkpoint({"step": 2, "w": torch.arange(2000)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == before and load(path)["step"] == 1
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == ["last.ckpt", "last.ckpt.sha256"], "a temporary file was left"


def test_truncated_checkpoint_is_named(tmp_path, capsys, monkeypatch):
    from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(10_000)}}, path)
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CorruptCheckpointError, match="last.ckpt is truncated or corrupted"):
        AtomicCheckpointIO().load_checkpoint(path)
    model = tiny_hf_folder(tmp_path / "tiny", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    with pytest.raises(SystemExit) as e:  # resuming through the rlcu command: its default CheckpointIO names the file
        cli.main(["run", "quickstart", f"--ckpt_path={path}", "--trainer.logger=false", "--trainer.callbacks=[]",
                  f"--model.model={model}", "--model.max_prompt_length=64", "--model.max_completion_length=4"])
    assert e.value.code == 2 and "last.ckpt is truncated or corrupted" in capsys.readouterr().err


def test_bytes_damaged_in_the_middle_are_caught_by_the_checksum(tmp_path, capsys):
    """4 KB overwritten inside the tensor data unpickles fine; the saved sha256 catches it, in loading, in
    `rlcu export` and in resuming through the rlcu command."""
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(100_000)}, "hyper_parameters": {}}, path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(4096)
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=False)  # the damage alone does not stop the unpickler
    with pytest.raises(CorruptCheckpointError, match="sha256 differs"):
        load(path)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(path), str(tmp_path / "out")])
    assert e.value.code == 2 and "last.ckpt is truncated or corrupted" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "quickstart", f"--ckpt_path={path}", "--trainer.logger=false"])
    assert e.value.code == 2 and "sha256 differs" in capsys.readouterr().err


def test_a_checkpoint_without_a_checksum_still_loads(tmp_path):
    path = tmp_path / "other.ckpt"
    torch.save({"step": 7}, path)
    assert load(path)["step"] == 7


class _RunsCode:
    """What a malicious checkpoint holds: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path, capsys):
    import torch

    from rlcu import cli
    from rlcu.checkpoint import UnsafeCheckpointError, load

    marker = tmp_path / "code-ran"
    bad = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": "x"}, "payload": _RunsCode(str(marker))}, bad)
    with pytest.raises(UnsafeCheckpointError, match="holds Python objects beyond tensors.*weights only"):
        load(bad)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(bad), str(tmp_path / "out")])
    assert e.value.code == 2 and "weights only" in capsys.readouterr().err
    assert not marker.exists()
