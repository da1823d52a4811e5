import pytest
import torch

from rlcu import cli
from rlcu.devices import resolve_device


def test_auto_takes_the_gpu_torch_sees_and_names_pass_once_checked(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"


@pytest.mark.parametrize("name, gpus, says", [
    ("tpu", 0, "--device 'tpu' is not a device rlcu runs on; use auto, cpu, cuda or cuda:N"),
    ("mps", 0, "--device 'mps' is not a device rlcu runs on"),
    ("cuda", 0, "--device cuda: torch sees no CUDA device on this machine"),
    ("cuda:2", 2, "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
])
def test_a_device_this_machine_lacks_is_one_line_naming_what_there_is(monkeypatch, name, gpus, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ValueError) as e:
        resolve_device(name)
    assert str(e.value).startswith(says)


@pytest.mark.parametrize("command", [["generate", "--input", "p.jsonl", "--output", "o.jsonl"], ["bench", "rollout"]])
def test_the_commands_refuse_it_before_any_work(tmp_path, monkeypatch, capsys, command):
    import rlcu.models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "t1"}\n')
    monkeypatch.setattr(rlcu.models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--device", "tpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "'tpu' is not a device rlcu runs on" in err
