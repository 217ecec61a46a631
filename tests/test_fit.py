"""The foundation: fit() on Ray actors trains what single-process PyTorch trains.

Tolerance: 1e-5 absolute on every parameter after 12 Adam steps (lr 1e-2). The distributed
run computes the same mean gradient over the same G samples; only the order of the float32
additions differs (a sum of per-rank partial means instead of one mean), which moves gradients
by ~1e-7 relative. Adam's update is bounded by lr per step and is smooth in the gradient away
from v ~ 0, so 12 steps keep the parameters within ~1e-6 of each other; we observe <= 2e-7.
"""

from __future__ import annotations

import json
import os

import pytest

import elastic
from elastic.config import loss_function
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

STEPS = 12
G = 10
TOL = 1e-5


def _fit(tmp_path, **kw):
    cfg = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
               max_steps=STEPS, num_workers=2, view="none", run_dir=str(tmp_path / "run"))
    cfg.update(kw)
    return elastic.fit(**cfg)


@pytest.fixture(scope="module")
def reference():
    return reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_dp_matches_single_process_pytorch(ray_local, tmp_path, reference, workers):
    ref_state, ref_losses = reference
    result = _fit(tmp_path, num_workers=workers)
    assert max_diff(result.state_dict(), ref_state) < TOL
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert abs(result.history[-1]["loss"] - ref_losses[-1]) < 1e-5
    h = result.history[-1]
    assert h["world_size"] == workers and h["strategy"] == "dp" and h["samples_per_s"] > 0
    kinds = [e.kind for e in result.events]
    assert kinds[0] == "start" and "placed" in kinds and kinds[-1] == "finished"


def test_run_dir_logs_and_data_coverage(ray_local, tmp_path):
    result = _fit(tmp_path, num_workers=3)
    run = result.run_dir
    metrics = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    events = [json.loads(x) for x in open(os.path.join(run, "events.jsonl"))]
    assert events[-1]["kind"] == "finished"
    # every sample of every step exactly once, across the workers' disjoint shares
    data = [json.loads(x) for x in open(os.path.join(run, "data_log.jsonl"))]
    assert [d["step"] for d in data] == list(range(STEPS))
    for d in data:
        assert d["ranges"] == [[0, 4], [4, 7], [7, 10]] and d["global_samples"] == G


def test_result_state_dict_is_plain_pytorch(ray_local, tmp_path):
    result = _fit(tmp_path, max_steps=2)
    model = mlp()
    model.load_state_dict(result.state_dict())  # strict: same FQNs, CPU tensors
    assert all(v.device.type == "cpu" for v in result.state_dict().values())


def test_yaml_job_equals_sdk_job(ray_local, tmp_path, reference):
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: tests.helpers:mlp\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        "loss: mse\n"
        "dataset: tests.helpers:RegressionData\n"
        f"global_batch_size: {G}\nmax_steps: {STEPS}\nnum_workers: 2\nview: none\n"
        f"run_dir: {tmp_path / 'yrun'}\n"
    )
    result = elastic.fit(str(job))
    assert max_diff(result.state_dict(), reference[0]) < TOL
    assert loss_function("mse") is not None


def test_parquet_dataset_uri(ray_local, tmp_path, reference):
    """A Parquet dataset read through pyarrow trains exactly what the in-memory one does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = RegressionData()
    table = pa.table({"x": pa.array(data.x.tolist(), type=pa.list_(pa.float32())),
                      "y": pa.array(data.y.tolist(), type=pa.list_(pa.float32()))})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    result = _fit(tmp_path, dataset=str(path))
    assert max_diff(result.state_dict(), reference[0]) < TOL
