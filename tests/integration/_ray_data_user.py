"""A user's Ray Data pipeline for tests/integration/test_ray_data.py: RegressionData's rows
as dict rows in several blocks, then a transform on the cluster (x -> 2x + 1, y -> y - 0.5).
``expected()`` is the same rows in memory, in order."""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.helpers import RegressionData

N = 96
BLOCKS = 5


def _transform(batch: dict[str, Any]) -> dict[str, Any]:
    if batch["slow"][0] and 0 in batch["i"]:  # the first rows finish last
        time.sleep(1.0)
    out = {"features": batch["x"] * 2.0 + 1.0, "label": batch["y"] - 0.5}
    if "pad" in batch:
        out["pad"] = batch["pad"]
    return out


def _fails(batch: dict[str, Any]) -> dict[str, Any]:
    raise ValueError("bad row in the pipeline")


CALLS = [0]  # how many times make_dataset ran (in this process: the driver)


def make_dataset(fail: bool = False, slow_first: bool = False, pad: int = 0,
                 empty: bool = False, n: int = N) -> Any:
    """``pad``: that many zeros per row in a third column (blocks over Ray's 100 KiB inline
    limit live in a node's object store, not in the driver's memory)."""
    import numpy as np
    import ray

    CALLS[0] += 1
    d = RegressionData(N)
    rows = [{"x": d.x[i].numpy(), "y": d.y[i].numpy(), "i": i, "slow": slow_first,
             **({"pad": np.zeros(pad, np.float32)} if pad else {})} for i in range(n)]
    ds = ray.data.from_items(rows, override_num_blocks=BLOCKS)
    if empty:
        ds = ds.filter(lambda row: False)
    return ds.map_batches(_fails if fail else _transform, batch_format="numpy", batch_size=16)


class Expected(torch.utils.data.Dataset):
    def __init__(self) -> None:
        d = RegressionData(N)
        self.x, self.y = d.x * 2.0 + 1.0, d.y - 0.5

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
