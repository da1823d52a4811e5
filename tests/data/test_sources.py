import itertools
from fractions import Fraction

import pytest

from rlcu.data.module import PromptDataModule
from rlcu.data.sources import build_dataset
from rlcu.data.tasks import arithmetic, countdown
from rlcu.rewards.math import MathAnswer

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


def test_arithmetic_is_deterministic_and_correct():
    rows = arithmetic(50, seed=3)
    assert rows == arithmetic(50, seed=3) and rows != arithmetic(50, seed=4)
    for r in rows:
        q = r["prompt"][0]["content"]
        a, b = (int(x) for x in q.removeprefix("What is ").split("?")[0].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a + b)


def test_arithmetic_plain_text_prompts_for_base_models():
    chat, plain = arithmetic(5, seed=3), arithmetic(5, seed=3, chat=False)
    assert [r["answer"] for r in plain] == [r["answer"] for r in chat]
    assert [r["prompt"] for r in plain] == [f"Question: {r['prompt'][0]['content']}\nAnswer:" for r in chat]
    with pytest.raises(ValueError, match="chat true or false, .* chat='maybe'"):
        arithmetic(5, chat="maybe")


def test_countdown_puzzles_are_solvable():
    for r in countdown(20, seed=1):
        nums, target = r["nums"], r["target"]
        solvable = False
        for perm in itertools.permutations(nums):
            for ops in itertools.product("+-*", repeat=len(nums) - 1):
                v = Fraction(perm[0])
                for op, x in zip(ops, perm[1:]):
                    v = v + x if op == "+" else v - x if op == "-" else v * x
                solvable |= v == target
        assert solvable, r


def test_gsm8k_loader_on_local_files():
    ds = build_dataset("gsm8k", {"path": str(FIXTURES / "gsm8k.jsonl")})
    assert sorted(ds.column_names) == ["answer", "prompt"] and ds["answer"] == ["8", "1230"]
    assert ds[0]["prompt"][-1]["role"] == "user" and "Tom has 3 apples" in ds[0]["prompt"][-1]["content"]
    assert MathAnswer()(["q"], ["so #### 1230"], [[1]], answer=[ds[1]["answer"]]) == [1.0]


def test_math_loader_on_local_files():
    ds = build_dataset("math", {"path": str(FIXTURES / "math.jsonl"), "system_prompt": "Be brief."})
    assert ds["answer"] == ["\\frac{3}{4}", "2\\sqrt{2}"]
    assert ds[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_bad_data_fails_at_setup_with_the_fix():
    needs = r"the gsm8k loader needs the column\(s\) \['question', 'answer'\]; the data has"
    with pytest.raises(KeyError, match=needs):
        build_dataset("gsm8k", {"path": str(FIXTURES / "math.jsonl")})
    with pytest.raises(KeyError, match=r"lacks the column\(s\) \['prompt'\]; it has \['answer', 'question'\]"):
        PromptDataModule(str(FIXTURES / "no_prompt.jsonl")).setup()
    with pytest.raises(KeyError, match=r"lacks the column\(s\) \['nope'\]; .* Rename columns to those names, or "
                                       r"drop them from data.required_columns"):
        PromptDataModule(arithmetic(8, seed=0), required_columns=["nope"]).setup()
    with pytest.raises(ValueError, match="is empty"):
        PromptDataModule([]).setup()
    with pytest.raises(ValueError, match=r"take 'seed' and 'n' \(or their own arguments\), not 'split'"):
        build_dataset("arithmetic", {"split": "test"})
    with pytest.raises(TypeError):
        build_dataset("arithmetic", {"digitz": 3})
    with pytest.raises(ValueError, match=r"unused dataset_args \['n'\] .*: drop them \(.*--data.dataset_args=\{\}\)"):
        build_dataset(str(FIXTURES / "no_prompt.jsonl"), {"n": 4})


@pytest.mark.parametrize("name, content", [("rows.parquet", b"PAR1 not a table"), ("rows.csv", b'"a,b\n1')])
def test_a_local_file_the_reader_refuses_is_named_in_the_error(tmp_path, name, content):
    """pyarrow's own message (a truncated parquet footer) names no file: the error does."""
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=f"^could not read {bad}: "):
        build_dataset(str(bad), {})


def test_a_hub_dataset_out_of_reach_is_one_user_error_line(monkeypatch):
    """A ValueError (a user error: `rlcu run` prints one line), where a RuntimeError printed a traceback."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/nothing' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError, match=r"^could not load dataset 'someone/nothing' \(split 'train'\): "
                                         r"ConnectionError: Couldn't reach 'someone/nothing' on the Hub "
                                         r"\(LocalEntryNotFoundError\)\. Offline\? Pass local files of the same "
                                         r"schema instead\.$"):
        build_dataset("someone/nothing", {})


def test_datamodule_batches_rows_reproducibly_and_wraps_text_as_chat():
    dm = PromptDataModule([{"prompt": f"q{i}", "answer": str(i)} for i in range(10)], batch_size=4, as_chat=True,
                          system_prompt="sys", seed=1)
    dm.setup()
    first = next(iter(dm.train_dataloader()))
    assert len(first) == 4 and first[0]["prompt"][0]["content"] == "sys"
    assert first == next(iter(dm.train_dataloader()))
