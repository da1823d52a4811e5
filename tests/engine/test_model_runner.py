import torch
from torch.nn.utils.rnn import pad_sequence

from rlcu.engine.model_runner import padded_table


def test_padded_table_pads_each_block_table_with_block_zero_as_int32():
    g = torch.Generator().manual_seed(0)
    tables = [torch.randint(1, 5000, (n,), generator=g).tolist() for n in (7, 1, 33, 0, 32, 5)]
    expected = pad_sequence([torch.tensor(t, dtype=torch.int32) for t in tables], batch_first=True, padding_value=0)
    got = padded_table(tables)
    assert got.dtype == torch.int32 and got.shape == (6, 33) and torch.equal(got, expected)
    assert padded_table([[], []]).shape == (2, 0)
