"""A Ray Data pipeline as a job's dataset (examples/ray_data.yaml): the rows of
``elastic.models.SyntheticRegression`` as a Ray dataset in 8 blocks, standardized on the
cluster by a ``map_batches``. Read ``ray.data.read_parquet("s3://...")`` (or any Ray Data
source) in place of ``from_numpy`` for your own data."""

from __future__ import annotations

from typing import Any

import numpy as np


def _standardize(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = batch["features"]
    return {"features": (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True)
                                                               + 1e-6),
            "target": batch["target"]}


def make(n: int = 4096) -> Any:
    import ray

    from elastic.models import SyntheticRegression

    d = SyntheticRegression(n=n)
    ds = ray.data.from_items([{"features": d.x[i].numpy(), "target": d.y[i].numpy()}
                              for i in range(n)], override_num_blocks=8)
    return ds.map_batches(_standardize, batch_format="numpy")
