"""Ray datasets without Ray: the blocks' row lookup, the setting's forms, and what a worker is
sent. (Running a pipeline on Ray: tests/integration/test_ray_data.py.)"""

from __future__ import annotations

import pickle
import time
from typing import Any

import pyarrow as pa
import pytest
import torch

from elastic.config import JobConfig
from elastic.config.datasets import check_dataset, is_parquet, is_ray_dataset
from elastic.errors import ConfigError
from elastic.ray_dataset import RayBlocks
from tests.helpers import RegressionData, adam, mlp, mse


def _blocks(sizes: list[int]) -> tuple[RayBlocks, torch.Tensor, torch.Tensor]:
    """Blocks of ``sizes`` rows (x: 3 numbers, y: one int) with their tables already
    fetched, and the whole columns in order."""
    n = sum(sizes)
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    y = torch.arange(n) * 10
    tables, lo = [], 0
    for s in sizes:
        tables.append(pa.table({"x": pa.array(x[lo:lo + s].tolist(), pa.list_(pa.float32(), 3)),
                                "y": pa.array(y[lo:lo + s].tolist(), pa.int64())}))
        lo += s
    b = RayBlocks([f"ref{i}" for i in range(len(sizes))], sizes, ("x", "y"), ("float32", "int64"))
    b._tables = dict(enumerate(tables))
    return b, x, y


@pytest.mark.parametrize("sizes", [[5], [3, 1, 7, 2], [1, 1, 1, 1, 1, 1]])
def test_rows_come_back_in_the_order_asked_from_whichever_block_holds_them(sizes):
    b, x, y = _blocks(sizes)
    assert len(b) == sum(sizes)
    g = torch.Generator().manual_seed(sum(sizes))
    for _ in range(5):
        idx = torch.randint(0, len(b), (9,), generator=g)  # repeats and any order
        bx, by = b.get_batch(idx)
        assert torch.equal(bx, x[idx]) and torch.equal(by, y[idx])
        assert bx.dtype == torch.float32 and by.dtype == torch.int64
    assert torch.equal(b[len(b) - 1][0], x[-1])
    assert torch.equal(b.head(2)[1], y[:2])
    assert b.get_batch(torch.tensor([], dtype=torch.long))[0].shape == (0, 3)


def test_blocks_of_different_arrow_types_read_as_the_settings_dtypes():
    b, x, y = _blocks([2, 3])
    t = b._tables[1]
    b._tables[1] = t.append_column("extra", pa.array(["a", "b", "c"]))  # one more column
    b._tables[0] = b._tables[0].cast(pa.schema([("x", pa.list_(pa.float64(), 3)),
                                                ("y", pa.int64())]))  # another type
    got = b.get_batch(torch.tensor([4, 0, 2]))
    assert torch.equal(got[0], x[[4, 0, 2]]) and torch.equal(got[1], y[[4, 0, 2]])


def test_a_row_outside_the_blocks_is_an_index_error():
    b, _, _ = _blocks([2, 2])
    with pytest.raises(IndexError, match="out of range"):
        b.get_batch(torch.tensor([4]))


def test_blocks_travel_without_their_tables():
    b, _, _ = _blocks([2, 3])
    c = pickle.loads(pickle.dumps(b))
    assert c._tables == {} and c.refs == b.refs and len(c) == 5
    assert "5 rows, 2 blocks" in repr(c)


class _FakeRayDataset:  # what is_ray_dataset looks for: ray.data's module and to_arrow_refs
    __module__ = "ray.data.dataset"

    def to_arrow_refs(self):
        raise AssertionError("not run here")


def test_a_ray_dataset_is_a_dataset_setting_without_running_it():
    ds = _FakeRayDataset()
    assert is_ray_dataset(ds) and not is_ray_dataset(RegressionData())
    check_dataset(ds, "dataset", None)  # taken as is
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=ds, global_batch_size=4,
                    max_steps=2)
    assert cfg.dataset_object() is ds


def test_dataset_format_ray_takes_a_factory_and_refuses_other_values():
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset="tests.helpers:RegressionData",
                    dataset_format="ray", global_batch_size=4, max_steps=2)
    assert cfg.dataset_format == "ray"
    assert not is_parquet("data.parquet", "ray")  # the format says what it is
    with pytest.raises(ConfigError) as e:
        JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                  dataset_format="ray", global_batch_size=4, max_steps=2)
    assert e.value.field == "dataset" and "Ray dataset" in str(e.value)
    with pytest.raises(ConfigError) as e:
        JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                  dataset_format="arrow", global_batch_size=4, max_steps=2)
    assert e.value.field == "dataset_format" and "ray" in str(e.value)


def test_a_worker_is_sent_the_blocks_never_the_pipeline_or_its_factory():
    b, _, _ = _blocks([4, 4])
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset="tests.helpers:RegressionData",
                    dataset_format="ray", eval_dataset=_FakeRayDataset(), global_batch_size=4,
                    max_steps=2)
    cfg.ray_blocks = {"dataset": b, "eval_dataset": b}
    w = cfg.for_worker()
    assert w.data.dataset is b and w.data.format is None and w.evaluation.dataset is b
    assert w.dataset_object() is b
    assert cfg.dataset == "tests.helpers:RegressionData"  # the user's setting is unchanged
    # a format-ray factory that gave a map-style dataset: the worker calls it, as without Ray
    cfg.ray_blocks = {}
    w = cfg.for_worker()
    assert w.data.format is None and len(w.dataset_object()) == 256


def test_a_pipeline_with_no_cpu_to_run_on_is_refused_not_left_waiting(monkeypatch):
    """Ray Data's tasks would wait for a CPU for ever, saying nothing on the driver."""
    import elastic.ray_connect as rc
    import elastic.ray_dataset as rd
    from elastic.errors import ClusterError
    from elastic.ray_dataset import materialize

    monkeypatch.setattr(rc, "free_cpus", lambda: 0.0)
    monkeypatch.setattr(rd, "CPU_WAIT_S", 0.1)
    with pytest.raises(ClusterError) as e:
        materialize(_FakeRayDataset(), "dataset", ("x", "y"), ("float32", "float32"))
    assert "free CPU" in str(e.value) and "add a node" in str(e.value)

    class MaterializedDataset(_FakeRayDataset):  # already run, but its blocks are counted
        context = type("C", (), {"execution_options": type("O", (), {"preserve_order": False})()})()

    with pytest.raises(ClusterError, match="a materialized dataset needs one too"):
        materialize(MaterializedDataset(), "dataset", ("x", "y"), ("float32", "float32"))


def test_blocks_whose_rows_differ_in_width_are_an_error_not_a_broadcast():
    b, _, _ = _blocks([2, 2])
    b._tables[1] = pa.table({"x": pa.array([[1.0], [2.0]], pa.list_(pa.float32(), 1)),
                             "y": pa.array([1, 2], pa.int64())})
    b.get_batch(torch.tensor([0]))  # block 0 first: rows of 3
    with pytest.raises(ValueError, match=r"'x' of the Ray dataset has rows of shape \(1,\)"):
        b.get_batch(torch.tensor([0, 3]))


def test_a_factory_that_returns_a_ray_dataset_needs_dataset_format_ray():
    """Called before Ray is up, it would be called again in every worker, unrun."""
    from elastic.control.preflight import _check_datasets

    for field in ("dataset", "eval_dataset"):
        kw = {"dataset": RegressionData(), field: _FakeRayDataset} if field == "eval_dataset" \
            else {"dataset": _FakeRayDataset}
        cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, global_batch_size=4, max_steps=2,
                        **kw)
        with pytest.raises(ConfigError) as e:
            _check_datasets(cfg, mlp())
        assert e.value.field == "dataset_format" and f"{field}'s factory" in str(e.value)
    # the dataset object itself is left to the controller, with Ray up
    _check_datasets(JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=_FakeRayDataset(),
                              global_batch_size=4, max_steps=2), mlp())


def test_a_parquet_eval_set_beside_a_ray_training_set_stays_parquet(tmp_path):
    import pyarrow.parquet as pq

    from elastic.data import ParquetDataset

    path = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [0.0, 1.0]}), path)
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset="tests.helpers:RegressionData",
                    dataset_format="ray", eval_dataset=str(path), global_batch_size=4,
                    max_steps=2)
    assert isinstance(cfg.eval_dataset_object(), ParquetDataset)


def test_rays_own_failures_are_told_from_the_pipelines():
    from elastic.ray_dataset import _ray_fault

    def made(name):
        return type(name, (Exception,), {"__module__": "ray.exceptions"})()

    assert _ray_fault(made("ObjectLostError")) and _ray_fault(made("OutOfMemoryError"))
    assert not _ray_fault(made("RayTaskError(UserCodeException)"))
    assert not _ray_fault(ValueError("the user's"))


class _Pool:
    """What PoolRoom uses of a WorkerPool; its take frees a CPU as retiring a worker does."""

    def __init__(self, idle: int, cpus: list[float]) -> None:
        self.idle, self.cpus, self.taken, self.placed = idle, cpus, [], 0

    def info(self):
        return {"idle": self.idle}

    def take(self, key, n, free_bundles):
        self.taken.append((key, n, free_bundles))
        self.idle -= 1
        self.cpus[0] += 1.0
        return []

    def cold_placed(self, n):
        self.placed += n


def test_a_pools_idle_worker_gives_its_cpu_to_the_pipeline_and_the_refill_waits(monkeypatch):
    import elastic.ray_connect as rc
    from elastic.ray_dataset import PoolRoom

    cpus = [0.0]
    monkeypatch.setattr(rc, "free_cpus", lambda: cpus[0])
    pool = _Pool(2, cpus)
    room = PoolRoom(pool, wait_s=0.5)
    assert room.make() and room.held == 1 and pool.placed == 0  # no refill meanwhile
    key, n, free = pool.taken[0]
    assert n == 1 and free == 0 and key == PoolRoom.KEY  # a key no worker has: none handed out
    room.done()
    assert pool.placed == 1 and room.held == 0
    assert not PoolRoom(_Pool(0, [0.0])).make()  # nothing idle to give
    assert not PoolRoom(None).make()


def test_preparing_lets_the_pool_refill_even_when_the_pipeline_fails(monkeypatch):
    import elastic.ray_dataset as rd

    pool = _Pool(1, [0.0])

    def fails(cfg, model, emit, room):
        room.held = 1
        raise ConfigError("dataset", "broken", "fix it")

    monkeypatch.setattr(rd, "_prepare", fails)
    with pytest.raises(ConfigError):
        rd.prepare(None, None, None, pool)
    assert pool.placed == 1


def test_a_pooled_placements_copy_of_the_config_sends_the_blocks_too():
    """A WorkerPool's placement sends ``config.replace(placement=...)``: without the blocks,
    its workers got the pipeline itself, unrun, and failed on len()."""
    b, _, _ = _blocks([4, 4])
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=_FakeRayDataset(),
                    global_batch_size=4, max_steps=2)
    cfg.ray_blocks = {"dataset": b}
    assert cfg.replace(placement="per_worker").for_worker().data.dataset is b


@pytest.mark.parametrize("name", ["gpt.yaml", "ray_data.yaml"])
def test_the_example_job_files_build(name):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = JobConfig.from_yaml(os.path.join(root, "examples", name))
    assert cfg.max_steps > 0
    # what the examples show is protected: a sharded layout with neither checkpoints nor peer
    # copies gets an "unprotected" warning (ray_data.yaml under zero2 got it)
    from types import SimpleNamespace

    from elastic.control.layouts import unprotected

    spec = SimpleNamespace(name=cfg.strategy, world_size=cfg.num_workers, pp_degree=1,
                           dp_mode=None)  # neither example is a pipeline
    assert not unprotected(spec, cfg), name


@pytest.mark.parametrize(("nbytes", "target", "want"), [
    ([], 10, []),
    ([3], 10, [[0]]),
    ([3, 3, 3, 3], 10, [[0, 1, 2], [3]]),         # a run stops before it would pass target
    ([5, 5, 5], 10, [[0, 1], [2]]),               # exactly target is one run
    ([12, 2, 2, 12, 1], 10, [[0], [1, 2], [3], [4]]),  # a large block is a run of its own
    ([0, 4, 0, 4], 4, [[0, 1, 2], [3]]),
])
def test_small_neighbouring_blocks_are_joined_in_order_up_to_the_target(nbytes, target, want):
    from elastic.ray_dataset import merge_groups

    got = merge_groups(nbytes, target)
    assert got == want
    assert [i for g in got for i in g] == list(range(len(nbytes)))  # every block once, in order


def test_joined_tables_read_as_their_blocks_did():
    """What a join task does (``ray_connect._join``) keeps every row in order, one chunk, and
    tables that cannot join come back as not joined."""
    from elastic.ray_connect import _join

    b, x, y = _blocks([3, 1, 7, 2])
    ok, t = _join(*[b._tables[i] for i in range(4)])
    assert ok and t.column("x").num_chunks == 1
    one = RayBlocks(["ref"], [13], ("x", "y"), ("float32", "int64"))
    one._tables = {0: t}
    got_x, got_y = one.get_batch(torch.arange(13).flip(0))
    assert torch.equal(got_x, x.flip(0)) and torch.equal(got_y, y.flip(0))
    assert _join(b._tables[0], pa.table({"z": [1.0]})) == (False, None)


def test_a_list_column_whose_rows_differ_in_length_is_an_error_not_a_reshape():
    """2 rows of 2 values and 2 of 6 hold 16 values: cut into 4 rows of 4, without the check."""
    from elastic.data import column_array

    t = pa.table({"x": pa.array([[1.0, 2.0], [3.0] * 6, [4.0] * 6, [5.0, 6.0]])})
    with pytest.raises(ValueError, match="'x' has rows of 2 to 6 values"):
        column_array(t, "x", "float32")
    even = pa.table({"x": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.large_list(pa.float64()))})
    assert column_array(even, "x", "float32").tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_two_jobs_share_a_pipelines_run_only_when_it_is_the_same_pipeline():
    """``data_key``: what a sweep keys its one run of a Ray dataset on."""
    from elastic.ray_dataset import data_key

    def job(**kw):
        base = dict(model=mlp, optimizer=adam, loss=mse, global_batch_size=4, max_steps=2,
                    dataset="tests.helpers:RegressionData", dataset_format="ray",
                    input_column="x", target_column="y")
        return JobConfig(**{**base, **kw})

    assert data_key(job()) == data_key(job(optimizer={"name": "sgd", "lr": 0.1}))
    assert data_key(job()) != data_key(job(input_column="x2"))
    assert data_key(job()) != data_key(job(input_dtype="float64"))
    assert data_key(job()) != data_key(job(dataset={"target": "tests.helpers:RegressionData",
                                                    "n": 8}))
    assert data_key(job(dataset=RegressionData(), dataset_format=None)) is None  # not Ray
    ds, other = _FakeRayDataset(), _FakeRayDataset()
    assert data_key(job(dataset=ds, dataset_format=None)) == data_key(
        job(dataset=ds, dataset_format=None))
    assert data_key(job(dataset=ds, dataset_format=None)) != data_key(
        job(dataset=other, dataset_format=None))


def test_a_sweeps_trials_share_one_run_of_their_pipeline_and_let_go_at_the_end(monkeypatch):
    """``TrialRunner._shared_data`` over its table, without Ray (``prepare`` counted): trials
    of one pipeline, even at once, run it once; another pipeline runs it again and only the
    last is kept; a trial keeps its own blocks; ``release`` lets go; no Ray dataset, no
    run."""
    import threading

    import elastic.ray_dataset as rd
    from elastic.sweep.runner import TrialRunner

    runs: list[Any] = []
    made: dict[str, RayBlocks] = {}

    def fake_prepare(cfg, model, emit, pool):
        assert model is None  # each trial's job checks its own model
        time.sleep(0.05)  # a slow pipeline: the other trials wait for it
        runs.append(cfg.input_column)
        made[cfg.input_column] = RayBlocks(["ref"], [3], ("x", "y"), ("float32", "float32"))
        return {"dataset": made[cfg.input_column]}

    def blocks_of(col):
        return {"dataset": made[col]}

    monkeypatch.setattr(rd, "prepare", fake_prepare)
    runner = TrialRunner.__new__(TrialRunner)  # (no sweep file: only what _shared_data uses)
    runner.out, runner.pool, runner._lock = None, None, threading.Lock()
    runner._data, runner._data_lock = None, threading.Lock()

    def job(col="x", **kw):
        base = dict(model=mlp, optimizer=adam, loss=mse, global_batch_size=4, max_steps=2,
                    dataset="tests.helpers:RegressionData", dataset_format="ray",
                    input_column=col, target_column="y")
        return JobConfig(**{**base, **kw})

    jobs = [job() for _ in range(4)]
    threads = [threading.Thread(target=runner._shared_data, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runs == ["x"] and all(j.ray_blocks == blocks_of("x") for j in jobs)
    first = made["x"]
    other = job("x2")
    runner._shared_data(other)
    assert runs == ["x", "x2"] and other.ray_blocks == blocks_of("x2")
    assert jobs[0].ray_blocks == {"dataset": first}  # a running trial keeps its own
    runner._shared_data(again := job())
    assert runs == ["x", "x2", "x"] and again.ray_blocks == blocks_of("x")
    runner.release()
    assert runner._data is None
    plain = job(dataset=RegressionData(), dataset_format=None)
    runner._shared_data(plain)
    assert runs == ["x", "x2", "x"] and plain.ray_blocks == {}


@pytest.mark.parametrize("values, kind", [
    ([[1.0, 2.0], None, [5.0, 6.0]], None), ([None, None], None), ([1.0, None], None),
    ([[1.0, 2.0], None], pa.list_(pa.float32(), 2)),  # fixed-size lists too
])
def test_a_column_with_null_rows_is_an_error_naming_it(values, kind):
    from elastic.data import column_array

    with pytest.raises(ValueError, match="'x' has [12] null rows"):
        column_array(pa.table({"x": pa.array(values, kind)}), "x", "float32")
