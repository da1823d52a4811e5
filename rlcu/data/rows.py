"""Training rows as a view: a list of dicts or a `datasets.Dataset`, some of its rows (after the held-out ones
are removed), each row turned into a chat prompt when it is read. Nothing is copied at set-up, so a dataset
of millions of rows costs its Arrow file's memory map and a list of row indices, not a Python dict per row;
`column` and `chunks` read a dataset by column, which is a hundred times faster than row by row."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

CHUNK = 8192  # rows read at once by `chunks`


class RowView(Sequence):
    def __init__(self, base, indices: Sequence[int] | None = None, transform: Callable[[dict], dict] | None = None):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._rows(range(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        row = dict(self.base[self.base_index(i % len(self))])
        return self.transform(row) if self.transform else row

    def __iter__(self) -> Iterator[dict]:
        for chunk in self.chunks():
            yield from chunk

    def base_index(self, i: int) -> int:
        """The base's row at position i of the view."""
        return i if self.indices is None else self.indices[i]

    def _raw(self, positions: range) -> list[dict]:
        """The base's rows at these positions of the view, untransformed; a dataset is read by column."""
        where = [self.base_index(i) for i in positions]
        if hasattr(self.base, "column_names"):
            columns = self.base[where]  # a dataset given a list of indices answers {column: [values]}
            return [dict(zip(columns, values)) for values in zip(*columns.values())]
        return [dict(self.base[i]) for i in where]

    def _rows(self, positions: range) -> list[dict]:
        rows = self._raw(positions)
        return [self.transform(r) for r in rows] if self.transform else rows

    def chunks(self, size: int = CHUNK) -> Iterator[list[dict]]:
        for start in range(0, len(self), size):
            yield self._rows(range(start, min(start + size, len(self))))

    def column(self, name: str) -> list[Any]:
        """One column of every row as the base holds it (untransformed), read by column where it is a dataset."""
        if self.indices is None and hasattr(self.base, "column_names"):
            return list(self.base[name])
        out = []
        for start in range(0, len(self), CHUNK):
            out += [r[name] for r in self._raw(range(start, min(start + CHUNK, len(self))))]
        return out
