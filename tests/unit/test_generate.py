import json

import pytest

from rlcu import cli
from rlcu.models import load_model
from rlcu.rollout import SamplingParams
from tests.helpers import CHAT_TEMPLATE, reference_generate, tiny_hf_folder


@pytest.fixture
def tiny(tmp_path):
    return tiny_hf_folder(tmp_path / "m", "llama", chat_template=CHAT_TEMPLATE)


def test_generate_writes_completions_matching_the_reference_backend(tmp_path, tiny):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t1 t2 t3", "id": "a"}\n\n{"messages": [{"role": "user", "content": "t5"}]}\n')
    out = tmp_path / "o.jsonl"
    cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(out), "--max_tokens", "6",
              "--n", "2"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)] and rows[0]["id"] == "a"
    assert rows[0]["completion_ids"] == rows[1]["completion_ids"]  # greedy: both samples agree
    model, tok = load_model(tiny)
    want = reference_generate(model, [rows[0]["prompt_ids"], rows[2]["prompt_ids"]],
                        SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[63]))
    assert [rows[0]["completion_ids"], rows[2]["completion_ids"]] == want.completion_ids
    assert all(len(r["logprobs"]) == len(r["completion_ids"]) for r in rows)
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert rows[0]["completion"] == tok.decode(rows[0]["completion_ids"], skip_special_tokens=True)
    penalized = tmp_path / "r.jsonl"
    cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(penalized), "--max_tokens",
              "6", "--repetition_penalty", "1.5"])
    got = [json.loads(line)["completion_ids"] for line in penalized.read_text().splitlines()]
    want = reference_generate(model, [rows[0]["prompt_ids"], rows[2]["prompt_ids"]],
                              SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[63], repetition_penalty=1.5))
    assert got == want.completion_ids


def test_generate_bad_input_names_the_line(tmp_path, tiny, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "t1"}\n{"prompt": "t2",\n')
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(tiny), "--input", str(bad), "--output", str(tmp_path / "o.jsonl")])
    assert f"{bad}:2 is not valid JSON" in capsys.readouterr().err
    bad.write_text('{"text": "t1"}\n')
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(tiny), "--input", str(bad), "--output", str(tmp_path / "o.jsonl")])
    assert "needs a 'prompt'" in capsys.readouterr().err


def test_an_unwritable_output_is_an_error_before_any_work(tmp_path, tiny, capsys, monkeypatch):
    """Checked before the model loads (it used to fail after generating, losing the completions); the same
    for `rlcu export`'s folder."""
    import rlcu.models

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t1"}\n')
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(rlcu.models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(blocker / "out.jsonl")])
    assert e.value.code == 2 and "--output" in capsys.readouterr().err
    import rlcu.checkpoint

    monkeypatch.setattr(rlcu.checkpoint, "load", lambda *a, **k: pytest.fail("the checkpoint loaded before the check"))
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(tmp_path / "x.ckpt"), str(blocker / "folder")])
    assert e.value.code == 2 and "cannot write there" in capsys.readouterr().err


def test_token_id_prompts_generate_as_their_text_does_and_need_no_tokenizer(tmp_path, tiny, capsys):
    """vLLM's 'prompt_token_ids' rows: taken as they are, beside text rows, and the only prompts a model without a
    tokenizer can take (a folder of weights alone, as transformers' config classes save them)."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text('{"prompt": "t1 t2 t3"}\n')
    cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(out), "--max_tokens", "6"])
    text_row = json.loads(out.read_text())
    ids = text_row["prompt_ids"]
    prompts.write_text(json.dumps({"prompt_token_ids": ids, "id": 7}) + '\n{"prompt": "t4"}\n')
    cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(out), "--max_tokens", "6"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["prompt_ids"] == ids and rows[0]["completion_ids"] == text_row["completion_ids"]
    assert rows[0]["completion"] == text_row["completion"] and rows[0]["id"] == 7 and rows[1]["prompt_ids"] != ids

    bare = tmp_path / "bare"  # the same weights without the tokenizer's files
    bare.mkdir()
    for f in tiny.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(bare), "--input", str(prompts), "--output", str(out), "--max_tokens", "6"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "has no tokenizer, so the text prompts" in err and "(row 2 the first)" in err
    prompts.write_text(json.dumps({"prompt_token_ids": ids}) + "\n")
    cli.main(["generate", "--model", str(bare), "--input", str(prompts), "--output", str(out), "--max_tokens", "6"])
    row = json.loads(out.read_text())
    assert row["completion_ids"] == text_row["completion_ids"] and row["completion"] is None


@pytest.mark.parametrize("ids, says", [("[]", "non-empty list"), ('["t1"]', "non-empty list"), ("[-1]", "ints >= 0"),
                                       ("[true]", "ints >= 0"), ("7", "non-empty list"),
                                       ("[3, 64]", "holds token id 64, past the model's vocabulary of 64")])
def test_bad_token_id_prompts_are_one_line_errors(tmp_path, tiny, capsys, ids, says):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t1"}\n{"prompt_token_ids": ' + ids + "}\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl")])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and says in err and ("p.jsonl:2" in err or "row 2 of" in err), err


def test_a_prompt_past_the_context_is_refused_before_any_work(tmp_path, tiny, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(["t1"] * 1000)}) + "\n")  # the tiny model's context: 1024
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tiny), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                  "--max_tokens", "100"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "prompt 0 of" in err and "passes the model's context of 1024" in err


@pytest.mark.slow
def test_sigterm_stops_a_long_generate_within_seconds_and_writes_nothing(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    big = tiny_hf_folder(tmp_path / "big", "llama", vocab_size=4096, hidden=32, heads=4, kv_heads=2, head_dim=8,
                         max_position_embeddings=8192)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "t1 t2"}) + "\n")
    out = tmp_path / "o.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "rlcu.cli", "generate", "--model", str(big), "--input",
                             str(prompts), "--output", str(out), "--n", "64", "--max_tokens", "8000",
                             "--temperature", "1.0"], env=dict(os.environ, PYTHONPATH=root),
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(20)  # the model loads and the rollout (64 completions of up to 8000 tokens) is under way
        assert proc.poll() is None, proc.communicate(timeout=5)[1][-1500:]
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and took < 10, (took, err[-1500:])
    assert "stopped by SIGTERM; nothing written" in err and not out.exists()
