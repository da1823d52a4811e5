"""The prompt data module's resume position: a run resumed mid-epoch with another batch_size starts after the rows the
checkpoint trained on (the checkpoint keeps the batch size it trained with), not after as many batches of the new
size."""
from types import SimpleNamespace

from rlcu.data.module import PromptDataModule


def resumed_loader(state: dict | None, batch_size: int, batches_done: int):
    rows = [{"prompt": f"p{i}"} for i in range(24)]
    dm = PromptDataModule(rows, batch_size=batch_size, shuffle=True, seed=3)
    if state is not None:
        dm.load_state_dict(state)
    progress = lambda n: SimpleNamespace(current=SimpleNamespace(processed=n))  # noqa: E731
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress(batches_done)),
                           epoch_progress=progress(0))
    dm.trainer = SimpleNamespace(global_rank=0, world_size=1, fit_loop=loop, limit_val_batches=None)
    return [r["prompt"] for batch in dm.train_dataloader() for r in batch]


def test_a_resume_with_another_batch_size_starts_after_the_rows_trained_on():
    order = resumed_loader(None, 4, 0)
    checkpoint = PromptDataModule([{"prompt": "x"}], batch_size=4).state_dict()
    assert checkpoint == {"batch_size": 4}
    assert resumed_loader(checkpoint, 2, 3) == order[12:]  # 3 batches of 4 trained: row 12 is next
    assert resumed_loader(checkpoint, 4, 3) == order[12:]
    assert resumed_loader(None, 2, 3) == order[6:]  # a checkpoint without the size: batches of the current one
