"""A Ray dataset's blocks on a node that is lost: Ray rebuilds them from their lineage, and a
job whose worker node goes trains on (and ends with the parameters of) the same rows."""

from __future__ import annotations

import os

import pytest
import torch

import elastic
from elastic.reference import reference_train
from tests.chaos.test_chaos import _wait_paused
from tests.helpers import adam, max_diff, mlp, mse
from tests.integration._ray_data_user import Expected, make_dataset

pytestmark = pytest.mark.chaos


def test_a_job_on_a_ray_dataset_survives_a_worker_node_loss(ray_cluster, tmp_path):
    """Rank 1 pauses at the start of step 8 and its node goes (with the blocks the pipeline
    left there): the survivors go on, and the parameters are the uninterrupted run's."""
    steps, g = 20, 12
    ref, _ = reference_train(mlp, adam, mse, Expected(), g, steps, seed=0)
    cluster = ray_cluster(3)
    faults = str(tmp_path / "faults")
    handle = elastic.submit(
        model=mlp, optimizer=adam, loss=mse, dataset=make_dataset(pad=4096), input_column="features",
        target_column="label", global_batch_size=g, max_steps=steps, num_workers=2,
        min_workers=1, view="none", run_dir=str(tmp_path / "run"), hang_timeout_s=30,
        replacement_timeout_s=2,
        faults=[{"rank": 1, "step": 8, "action": "pause", "dir": faults}])
    paused = _wait_paused(handle, os.path.join(faults, "paused-rank1-step8.json"))
    cluster.remove(paused["node_id"])
    result = handle.result(timeout=180)
    assert [h["step"] for h in result.history] == list(range(steps))
    assert any(e.kind == "recovered" for e in result.events)
    assert max_diff(result.state_dict(), ref) < 1e-5


def test_a_block_whose_node_is_lost_is_rebuilt_from_its_lineage(ray_cluster):
    import ray

    from elastic.ray_dataset import materialize

    # (after the job's test, which leaves its cluster with 2 nodes: none to add)
    cluster = ray_cluster(2)  # the head has no CPUs: the pipeline's blocks live on the two
    blocks = materialize(make_dataset(pad=4096), "dataset", ("features", "label"),
                         ("float32", "float32"))
    where = ray.experimental.get_object_locations(blocks.refs)
    nodes = {n for loc in where.values() for n in loc["node_ids"]}
    lost = sorted(nodes)[0]
    assert lost != cluster.cluster.head_node.node_id
    on_lost = [r for r in blocks.refs if lost in where[r]["node_ids"]]
    assert on_lost, where
    cluster.remove(lost)
    x, y = blocks.get_batch(torch.arange(len(blocks)))
    want = Expected()
    assert torch.equal(x, want.x) and torch.equal(y, want.y)
