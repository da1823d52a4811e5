"""Training rows as a view: a dataset of many rows is neither copied nor turned into dicts at set-up, and the
view reads as the list it replaces (held-out prompts removed, chat prompts made when a row is read)."""
import tracemalloc

import datasets
import pytest

from rlcu.data.module import PromptDataModule
from rlcu.data.rows import RowView


def test_a_view_reads_as_the_list_of_its_rows():
    base = [{"prompt": f"p{i}", "answer": i} for i in range(10)]
    chat = RowView(base, [1, 3, 5, 7], lambda r: dict(r, prompt=[{"role": "user", "content": r["prompt"]}]))
    assert len(chat) == 4 and chat[-1] == {"prompt": [{"role": "user", "content": "p7"}], "answer": 7}
    assert [r["answer"] for r in chat] == [1, 3, 5, 7] and chat[1:3] == [chat[1], chat[2]]
    assert chat.column("prompt") == ["p1", "p3", "p5", "p7"] and chat[0]["prompt"] == [
        {"role": "user", "content": "p1"}]
    with pytest.raises(IndexError):
        chat[4]
    table = RowView(datasets.Dataset.from_list(base), range(2, 10, 3))
    assert list(table) == [base[2], base[5], base[8]] and table.column("answer") == [2, 5, 8]
    assert [len(c) for c in RowView(base).chunks(4)] == [4, 4, 2]


def test_a_dataset_of_many_rows_is_held_out_and_converted_without_a_dict_per_row():
    n = 200_000
    table = datasets.Dataset.from_dict({"prompt": [f"What is {i % 150_000} + 1?" for i in range(n)],
                                        "answer": [str(i % 150_000 + 1) for i in range(n)]})
    dm = PromptDataModule(table, as_chat=True, system_prompt="Be brief.", val_size=10)
    tracemalloc.start()
    dm.setup("fit")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 60e6  # a chat dict per row, as before, held 156 MB here (23 MB now)
    assert isinstance(dm.train_set, RowView) and dm.train_set.base is table
    # the last 10 rows are held out, and so are the earlier copies of their prompts (rows 49,990 to 49,999)
    assert len(dm.train_set) == n - 20 and [r["answer"] for r in dm.val_set][0] == "49991"
    assert dm.train_set[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is 0 + 1?"}]
    held = {r["prompt"][-1]["content"] for r in dm.val_set}
    assert not held & {r["prompt"][-1]["content"] for r in dm.train_set}
