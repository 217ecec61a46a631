"""A Ray Data pipeline as a job's dataset: run once on the cluster, read by the workers from
its blocks, and trained on exactly as single-process PyTorch trains on the same rows.

Tolerance: 1e-5 on every parameter after 12 Adam steps (tests/integration/test_fit.py says
why); the rows themselves are bitwise those of the in-memory reference (the same float32
arithmetic on the same numbers), so only the order of additions differs.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

import elastic
from elastic.config import JobConfig
from elastic.errors import ConfigError
from elastic.reference import reference_train
from tests.helpers import adam, max_diff, mlp, mse
from tests.integration._ray_data_user import Expected, make_dataset

# (the jobs take the shared warm pool's workers; when its idle ones hold every CPU, one
# gives its CPU to the pipeline)

STEPS = 12
G = 10


def _job(tmp_path, **kw):
    cfg = dict(model=mlp, optimizer=adam, loss=mse, global_batch_size=G, max_steps=STEPS,
               num_workers=2, view="none", run_dir=str(tmp_path / "run"),
               input_column="features", target_column="label")
    cfg.update(kw)
    return JobConfig(**cfg)


@pytest.fixture(scope="module")
def reference():
    return reference_train(mlp, adam, mse, Expected(), G, STEPS, seed=0)


def test_a_ray_dataset_trains_what_pytorch_trains_on_its_rows(ray_local, tmp_path, reference):
    ref_state, _ = reference
    ds = make_dataset()
    cfg = _job(tmp_path, dataset=ds, eval_dataset=make_dataset(), eval_every=6)
    result = elastic.fit(cfg)
    assert ds.context.execution_options.preserve_order is False  # the user's, untouched
    assert max_diff(result.state_dict(), ref_state) < 1e-5
    # evaluation read the Ray blocks too: the mean loss of the final model over all rows
    model = mlp()
    model.load_state_dict(result.state_dict())
    data = Expected()
    with torch.no_grad():
        want = float(mse(model(data.x), data.y))
    assert abs(result.history[-1]["eval_loss"] - want) < 1e-5
    assert cfg.ray_blocks == {}  # the job let go of its blocks
    logged = json.load(open(os.path.join(result.run_dir, "config.json")))
    assert "Dataset" in str(logged["dataset"])
    ran = [e for e in result.events if e.kind == "data"]
    assert [(e.data["field"], e.data["rows"]) for e in ran] == [("dataset", 96),
                                                                ("eval_dataset", 96)]
    # 12 steps of 10 read the 96 rows twice: said, since the pipeline's randomness is not
    assert ran[0].data["epochs"] == 2 and "every epoch sees the same rows" in ran[0].message


def test_the_rows_keep_the_pipelines_order_when_its_first_block_finishes_last(ray_local):
    """Ray Data hands blocks on as they finish unless told to keep the order; elastic tells it
    (without that, this run gives rows 0-19 last: checked by hand)."""
    from elastic.ray_dataset import materialize

    blocks = materialize(make_dataset(slow_first=True), "dataset", ("features", "label"),
                         ("float32", "float32"))
    assert len(blocks.refs) == 1  # the pipeline's small blocks, joined end to end by a task
    x, y = blocks.get_batch(torch.arange(len(blocks)))
    want = Expected()
    assert torch.equal(x, want.x) and torch.equal(y, want.y)


@pytest.mark.parametrize("change, field, says", [
    ({"input_column": "x2"}, "input_column", "'x2' is not a column"),
    ({"dataset": {"target": "tests.integration._ray_data_user:make_dataset", "fail": True}},
     "dataset", "bad row in the pipeline"),
    ({"global_batch_size": 200}, "dataset", "fewer than one global batch"),
    ({"dataset": {"target": "tests.integration._ray_data_user:make_dataset", "empty": True}},
     "dataset", "has 0 samples"),
    ({"target_column": "features"}, "target_column", "the loss failed"),
])
def test_a_bad_pipeline_or_column_is_one_error_before_any_worker_starts(
        ray_local, tmp_path, change, field, says):
    kw = {"dataset": "tests.integration._ray_data_user:make_dataset", "dataset_format": "ray"}
    kw.update(change)
    with pytest.raises(ConfigError) as e:
        elastic.fit(_job(tmp_path, **kw))
    assert e.value.field == field and says in str(e.value)
    events = [json.loads(x)["kind"] for x in open(tmp_path / "run" / "events.jsonl")] \
        if (tmp_path / "run" / "events.jsonl").exists() else []
    assert "placed" not in events


def test_a_job_file_factory_resumed_under_zero2_reads_the_samples_one_run_would_have(
        ray_local, tmp_path, reference):
    """A factory named as a job file names it (dataset_format: ray), run on the cluster; the
    pipeline runs again in the resumed job (new blocks, new tasks) in the same order, so the
    resumed run, under another layout, ends where one uninterrupted run ends."""
    ref_state, _ = reference
    uri = str(tmp_path / "ck")
    common = dict(dataset="tests.integration._ray_data_user:make_dataset", dataset_format="ray",
                  checkpoint_uri=uri, name="raydata-resume")
    elastic.fit(_job(tmp_path, max_steps=6, checkpoint_every=3, **common))
    r = elastic.fit(_job(tmp_path, resume="latest", run_dir=str(tmp_path / "run2"),
                         strategy="zero2", **common))
    assert r.history[0]["step"] == 6 and r.history[-1]["strategy"] == "zero2"
    assert max_diff(r.state_dict(), ref_state) < 1e-5
    # a pipeline that now gives fewer rows: its length is known only once it ran, after the
    # resume was planned; the resume is refused then (was: another sample order from step 12)
    common["dataset"] = make_dataset(n=80)
    with pytest.raises(ConfigError, match="has 80 samples, but checkpoint step 12 was "
                                          "trained on 96"):
        elastic.fit(_job(tmp_path, resume="latest", run_dir=str(tmp_path / "run3"),
                         max_steps=16, **common))


@pytest.mark.cold_workers  # the test's own pool, holding every CPU of the cluster
def test_a_pool_holding_every_cpu_gives_one_to_the_pipeline(ray_local, tmp_path, reference):
    """The pipeline needs a CPU and a pool's idle workers hold all 4: the longest idle is
    retired ("room for a job"), the pipeline runs, and the job takes the others warm."""
    from elastic.ray_connect import free_cpus

    ref_state, _ = reference
    with elastic.WorkerPool(4, maintain_every_s=None) as pool:
        assert free_cpus() < 1
        result = elastic.fit(_job(tmp_path, dataset=make_dataset()), pool=pool)
        info = pool.info()
    assert any(why.startswith("room for a job") for why in info["retired"]), info
    placed = next(e for e in result.events if e.kind == "placed")
    assert placed.data["warm"] == 2
    assert max_diff(result.state_dict(), ref_state) < 1e-5


def test_a_sweep_runs_the_pipeline_once_for_all_its_trials(ray_local, tmp_path):
    """Two trials of a sweep over the learning rate read one run of the pipeline (it ran
    once per trial before: on a real dataset, a read of the whole dataset per trial); each
    trial still checks the model and loss on its rows, and trains its steps."""
    from elastic.sweep import optimize
    from tests.integration import _ray_data_user

    out = io.StringIO()
    before = _ray_data_user.CALLS[0]
    base = {"model": "tests.helpers:mlp", "optimizer": {"name": "adam", "lr": 0.01},
            "loss": "mse", "dataset": "tests.integration._ray_data_user:make_dataset",
            "dataset_format": "ray", "input_column": "features", "target_column": "label",
            "global_batch_size": G, "max_steps": 4, "num_workers": 1}
    study = optimize(base, {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 0.1,
                                             "log": True}}, 2,
                     storage=f"sqlite:///{tmp_path}/s.db", pruner="none", max_concurrent=1,
                     run_dir=str(tmp_path / "runs"), out=out)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2, out.getvalue()
    assert _ray_data_user.CALLS[0] - before == 1
    assert out.getvalue().count("ran the Ray dataset once for the trials") == 1
    for t in study.trials:
        assert t.user_attrs["steps"] == 4
        events = [json.loads(x) for x in
                  open(os.path.join(t.user_attrs["run_dir"], "events.jsonl"))]
        (data,) = [e for e in events if e["kind"] == "data"]
        assert data["data"]["shared"] and data["data"]["rows"] == 96
