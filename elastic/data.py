"""Deterministic data: which samples make up step s, and how they are split among workers.

Invariant (DESIGN.md): the G samples of step s depend only on (seed, s, G) and the dataset
length. Positions ``s*G .. s*G+G-1`` of an endless stream are drawn from per-epoch random
permutations, each seeded by (seed, epoch). Any plan splits exactly those G samples into
contiguous, disjoint shares in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "StepSampler",
    "even_shares",
    "share_bounds",
    "fetch_batch",
    "ParquetDataset",
    "ColumnError",
    "RowsChangedError",
]


class ColumnError(ValueError):
    """A Parquet dataset lacks ``column``, which the job's ``setting`` names (``have``:
    its columns)."""

    def __init__(self, message: str, setting: str, column: str, have: list[str]) -> None:
        super().__init__(message)
        self.setting, self.column, self.have = setting, column, have


class RowsChangedError(ValueError):
    """A Parquet dataset at ``uri`` read ``now`` rows where ``counted`` were counted when it
    was opened (files added, removed or rewritten in between): every row after the change
    would be another sample than its index says."""

    def __init__(self, uri: str, counted: int, now: int) -> None:
        super().__init__(
            f"Parquet dataset {uri} holds {now} rows now, where {counted} were counted when "
            "it was opened: its files changed in between, so its rows are no longer the ones "
            "their indices stand for (a file added before another shifts every row after it)")
        self.uri, self.counted, self.now = uri, counted, now


class StepSampler:
    """Maps a step to the dataset indices of its global batch.

    Thread-compatible (not thread-safe): keeps one cached epoch permutation.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, seed: int) -> None:
        if dataset_len < global_batch_size:
            raise ValueError(
                f"dataset has {dataset_len} samples, fewer than one global batch "
                f"({global_batch_size})"
            )
        self.n = dataset_len
        self.g = global_batch_size
        self.seed = seed
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF)
            self._perm = torch.randperm(self.n, generator=gen)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> torch.Tensor:
        """The G dataset indices of ``step`` (a LongTensor), in global order."""
        start = step * self.g
        out = torch.empty(self.g, dtype=torch.long)
        filled = 0
        while filled < self.g:
            pos = start + filled
            epoch, off = divmod(pos, self.n)
            take = min(self.g - filled, self.n - off)
            out[filled : filled + take] = self._permutation(epoch)[off : off + take]
            filled += take
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.g / self.n


def even_shares(global_batch_size: int, world_size: int) -> tuple[int, ...]:
    """Split G as evenly as possible; the first ``G % W`` ranks take one more sample."""
    base, extra = divmod(global_batch_size, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def share_bounds(shares: Sequence[int], rank: int) -> tuple[int, int]:
    lo = sum(shares[:rank])
    return lo, lo + shares[rank]


def fetch_batch(dataset: Any, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``indices`` from a map-style dataset of (input, target) pairs into two tensors.

    A dataset may offer ``get_batch(indices)`` for a vectorised path (ParquetDataset and the
    built-in datasets do); otherwise items are fetched one by one and stacked.
    """
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    xs, ys = zip(*(dataset[int(i)] for i in indices), strict=True)
    return _stack(xs), _stack(ys)


def _stack(items: Sequence[Any]) -> torch.Tensor:
    if isinstance(items[0], torch.Tensor):
        return torch.stack(list(items))
    return torch.as_tensor(items)


class ParquetDataset:
    """A Parquet dataset (file or directory, any pyarrow.fs URI) of (input, target) rows.

    ``input_column`` and ``target_column`` hold numbers or fixed-length lists of numbers.
    The table is read once per process, lazily, on first use; it must hold the rows
    ``len()`` counted in that process (``RowsChangedError`` otherwise). A pickled copy
    carries neither the table nor the count: each process counts the files it finds, so a
    worker's count is its own and ``JobData`` compares it with the driver's.
    """

    by_columns = True  # read by column: errors name input_column/target_column

    def __init__(
        self,
        uri: str,
        input_column: str = "x",
        target_column: str = "y",
        input_dtype: str = "float32",
        target_dtype: str = "float32",
    ) -> None:
        self.uri = uri
        self.input_column = input_column
        self.target_column = target_column
        self.input_dtype = input_dtype
        self.target_dtype = target_dtype
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._len: int | None = None

    def __getstate__(self) -> dict[str, Any]:  # ship the URI, never the table or its count
        d = dict(self.__dict__)  # (a count carried along would pass a worker's length check
        d["_x"] = d["_y"] = d["_len"] = None  # vacuously, whatever the files are by then)
        return d

    def __len__(self) -> int:
        if self._len is None:
            import pyarrow.dataset as pads

            ds = pads.dataset(self.uri, format="parquet")
            if not ds.files:
                raise FileNotFoundError(f"Parquet dataset {self.uri} holds no Parquet file")
            have = list(ds.schema.names)
            for setting, col in (("input_column", self.input_column),
                                 ("target_column", self.target_column)):
                if col not in have:
                    raise ColumnError(f"Parquet dataset {self.uri} has no column {col!r}; it "
                                      f"has {have}. Set {setting}", setting, col, have)
            self._len = ds.count_rows()
        return self._len

    def _load(self) -> None:
        import pyarrow.dataset as pads

        table = pads.dataset(self.uri, format="parquet").to_table(
            columns=[self.input_column, self.target_column]
        )
        x, y = self._tensors(table)
        if self._len is not None and len(x) != self._len:
            raise RowsChangedError(self.uri, self._len, len(x))
        self._x, self._y, self._len = x, y, len(x)

    def head(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` rows, read as ``get_batch`` reads them (same dtypes and shapes),
        without loading the whole table (the driver's preflight uses it)."""
        import pyarrow.dataset as pads

        table = pads.dataset(self.uri, format="parquet").head(
            n, columns=[self.input_column, self.target_column]
        )
        return self._tensors(table)

    def _tensors(self, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return (_column(table, self.input_column, self.input_dtype),
                _column(table, self.target_column, self.target_dtype))

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._x is None:
            self._load()
        assert self._x is not None and self._y is not None
        return self._x[indices], self._y[indices]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([i]))
        return x[0], y[0]


def _column(table: Any, name: str, dtype: str) -> torch.Tensor:
    """One column as a tensor of ``dtype``: numbers, or fixed-length lists of numbers (one
    row per sample)."""
    return torch.from_numpy(column_array(table, name, dtype).copy())


def column_array(table: Any, name: str, dtype: str) -> Any:
    """One column as a numpy array of ``dtype``, one row per sample: numbers (n,), lists of
    numbers of one length (n, k), or Ray Data's tensor columns (n, *shape). A view of the
    table's memory where Arrow allows it (one chunk, no nulls, the dtype already): may be
    read-only."""
    return storage_array(*column_storage(table, name), dtype)


def column_storage(table: Any, name: str) -> tuple[Any, tuple[int, ...]]:
    """One column as a plain Arrow array (a Ray tensor column's storage, zero-copy) and the
    shape of one row: () for numbers."""
    c = table.column(name)
    c = c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()
    if c.null_count:  # a reshape or a cast would fail on them, or read them as numbers
        raise ValueError(f"column {name!r} has {c.null_count} null rows: every row needs a "
                         "value (drop or fill them in the pipeline)")
    shape = getattr(c.type, "shape", None)
    if shape is not None and hasattr(c, "storage"):  # Ray Data's tensor extension type
        return c.storage, tuple(int(d) for d in shape)
    if str(c.type).startswith("fixed_size_list"):
        return c, (int(c.type.list_size),)
    if str(c.type).startswith(("list", "large_list")):
        if not len(c):
            return c, (0,)
        import pyarrow.compute as pc

        span = pc.min_max(pc.list_value_length(c))
        lo, hi = span["min"].as_py(), span["max"].as_py()
        if lo != hi:  # a reshape would cut the values into rows that are not the rows
            raise ValueError(f"column {name!r} has rows of {lo} to {hi} values: every row "
                             "must have the same length")
        return c, (int(lo),)
    return c, ()


def storage_array(arr: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """``column_storage``'s array as numpy, ``len(arr)`` rows of ``shape``, of ``dtype``."""
    import numpy as np

    if shape:
        flat = np.asarray(arr.flatten().to_numpy(zero_copy_only=False))
        out = flat.reshape(len(arr), *shape)
    else:
        out = np.asarray(arr.to_numpy(zero_copy_only=False))
    return out.astype(dtype, copy=False)
