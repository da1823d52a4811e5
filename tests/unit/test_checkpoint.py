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


def test_the_sum_hashed_while_writing_is_the_files(tmp_path, monkeypatch):
    """The sum is taken from the bytes on their way to disk; where torch.save did not write them in one ordered
    stream (its count differs from the file's size), the file is read back instead."""
    from rlcu.pypi_files import sha256

    path = tmp_path / "step.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(300_000)}, "step": 3}, path)
    digest, size = (tmp_path / "step.ckpt.sha256").read_text().split()
    assert digest == sha256(path) and int(size) == path.stat().st_size
    real_save = torch.save

    def seeking_save(obj, f, *a, **kw):  # a writer that goes back over its bytes
        real_save(obj, f, *a, **kw)
        f.f.seek(0)
        f.f.write(b"PK")

    monkeypatch.setattr(torch, "save", seeking_save)
    AtomicCheckpointIO().save_checkpoint({"step": 4}, path)
    assert (tmp_path / "step.ckpt.sha256").read_text().split()[0] == sha256(path) and load(path)["step"] == 4


def test_a_link_is_checked_against_its_targets_sum(tmp_path):
    """`save_last: link`: last.ckpt becomes a link to the step's file, and a .sha256 of its own left from when
    last.ckpt was a file (a run's end saves it whole) no longer applies."""
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    io.save_checkpoint({"step": 250, "w": torch.randn(50_000)}, tmp_path / "step=250.ckpt")
    (tmp_path / "last.ckpt").unlink()
    (tmp_path / "last.ckpt").symlink_to("step=250.ckpt")
    assert (tmp_path / "last.ckpt.sha256").exists() and load(tmp_path / "last.ckpt")["step"] == 250
    data = bytearray((tmp_path / "step=250.ckpt").read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    (tmp_path / "step=250.ckpt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="step=250.ckpt is truncated.*sha256 differs"):
        load(tmp_path / "last.ckpt")


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
