"""`rlcu export`: a trained checkpoint becomes an HF folder that transformers loads, with our logits."""
import os

import pytest
import torch

from rlcu import cli
from rlcu.models import load_model
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder


def train_two_steps(start, tmp_path, *extra):
    """Two GRPO steps of the quickstart on `start` that save a checkpoint; returns its path."""
    cli.main(["run", "quickstart", f"--model.model={start}", "--model.max_completion_length=4",
              "--model.max_prompt_length=64", "--model.rewards=[tests.helpers.first_token_value]",
              "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
              "--trainer.callbacks=[]", "--trainer.enable_checkpointing=true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.save_last=true", *extra])
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exported_checkpoint_loads_in_transformers_with_matching_logits(tmp_path, monkeypatch, family):
    import transformers

    monkeypatch.chdir(tmp_path)
    start = tiny_hf_folder(tmp_path / "tiny", family, vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE, **({"tie_word_embeddings": True} if family == "qwen3" else {}))
    ckpt = train_two_steps(start, tmp_path, "--model.learning_rate=1e-2")
    cli.main(["export", str(ckpt), str(tmp_path / "out")])

    trained = {k.removeprefix("policy."): v for k, v in torch.load(ckpt, weights_only=False)["state_dict"].items()}
    ours, _ = load_model(start)
    before = ours.model.embed_tokens.weight.detach().clone()
    ours.load_state_dict(trained, strict=False)
    assert not torch.equal(before, ours.model.embed_tokens.weight), "training changed nothing: a weak test"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.randint(0, 30, (2, 11))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours.logits(ids), atol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("t1 t2").input_ids
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}["model.safetensors"] == \
        0o666 & ~umask  # readable by others, as transformers writes (it was 0600)
    with pytest.raises(SystemExit) as e:  # a second export into the same folder would overwrite it in silence
        cli.main(["export", str(ckpt), str(tmp_path / "out")])
    assert e.value.code == 2
    cli.main(["export", str(ckpt), str(tmp_path / "out"), "--overwrite"])


def test_export_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"not a checkpoint")
    for argv, needle in ([str(tmp_path / "missing.ckpt"), "does not exist"], [str(bad), "truncated or corrupted"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["export", argv, str(tmp_path / "out")])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_lora_run_exports_peft_adapters_and_a_merged_folder(tmp_path, monkeypatch):
    """`--model.peft_config` trains adapters; `rlcu export` writes them in PEFT's format (PEFT loads them onto
    the transformers model) and `--merge` a full HF folder: the two give the same logits."""
    peft = pytest.importorskip("peft")
    import transformers

    monkeypatch.chdir(tmp_path)
    start = tiny_hf_folder(tmp_path / "tiny", "qwen3", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                           chat_template=CHAT_TEMPLATE)
    ckpt = train_two_steps(start, tmp_path, "--model.learning_rate=5e-2",
                           "--model.peft_config={r: 4, lora_alpha: 8, target_modules: all-linear}")
    cli.main(["export", str(ckpt), str(tmp_path / "adapter")])
    cli.main(["export", str(ckpt), str(tmp_path / "merged"), "--merge"])
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval()
    ids = torch.randint(0, 30, (2, 6))
    with torch.no_grad():
        a, m, p = adapted(ids).logits, merged(ids).logits, plain(ids).logits
    assert (a - m).abs().max() < 1e-5
    assert (a - p).abs().max() > 1e-4, "the adapters changed nothing: a weak test"
