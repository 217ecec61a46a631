"""The rows a job trains and evaluates on are the ones its driver read (no Ray).

A Parquet directory that gains a file while a job runs shifts every row after it; a worker
that joins later (a replacement, a resize) would train another sample order, or score another
evaluation set than its peers. The driver's preflight records both lengths; a worker that
reads another refuses (``JobData``), and a ``ParquetDataset`` refuses to read a table of
another length than it counted. The evaluation set gets the model/loss check the training
set gets, before Ray (found by review).

Where a test goes through ``elastic.fit``, the controller's connection to Ray is replaced by a
guard (as in ``test_config.py``): the error must come from the preflight."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import elastic
from elastic.config import JobConfig
from elastic.data import ParquetDataset, RowsChangedError
from elastic.errors import ConfigError
from elastic.worker.inputs import JobData
from tests.helpers import RegressionData, adam, mlp, mse

G = 4


class ReachedRay(Exception):
    pass


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """``elastic.fit`` stops where it would connect to Ray (after the preflight); the config
    it would have connected with is kept in ``tmp_path.seen``."""
    from elastic.control import controller

    seen: list[Any] = []

    def guard(cfg, *_):
        seen.append(cfg)
        raise ReachedRay("the preflight passed")

    monkeypatch.setattr(controller, "_ray_connect", guard)
    return tmp_path, seen


def _rows(path: Any, values: list[int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": pa.array(values, type=pa.float32()),
                             "y": pa.array(values, type=pa.float32())}), str(path))


def _cfg(tmp_path: Any, **kw: Any) -> JobConfig:
    base: dict[str, Any] = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                                global_batch_size=G, max_steps=10, num_workers=1,
                                run_dir=str(tmp_path / "run"))
    base.update(kw)
    return JobConfig(**base)


# ------------------------------------------------------------------ a Parquet dir that grows

def test_a_pickled_parquet_dataset_counts_its_own_rows_and_a_grown_one_is_refused(tmp_path):
    """The reviewer's case: b.parquet holds rows 0-7 when the driver counts; a.parquet (rows
    100, 101) is added before a worker reads. Was: the pickled dataset answered the driver's
    8, the length check passed, and the worker trained rows [100, 101, 0, 1, ...]."""
    data = tmp_path / "data"
    data.mkdir()
    _rows(data / "b.parquet", list(range(8)))
    ds = ParquetDataset(str(data))
    assert len(ds) == 8  # the driver's count
    cfg = _cfg(tmp_path, dataset=ds)
    cfg.dataset_length = 8
    sent = pickle.dumps(cfg.for_worker())  # what a worker gets, later
    _rows(data / "a.parquet", [100, 101])
    worker = pickle.loads(sent)
    assert len(worker.dataset_object()) == 10  # its own count, not the driver's
    with pytest.raises(ConfigError, match=r"dataset: this worker reads 10 samples, where the "
                                          r"job read 8"):
        JobData(worker).load()


def test_a_file_added_between_the_count_and_the_read_is_refused(tmp_path):
    """Was: ``_load`` listed the directory again at the first batch and took the new length
    as it came: every row shifted by the rows of the file sorted before."""
    data = tmp_path / "data"
    data.mkdir()
    _rows(data / "b.parquet", list(range(8)))
    same = ParquetDataset(str(data))
    assert len(same) == 8
    assert same.get_batch(torch.tensor([0, 7]))[0].tolist() == [0.0, 7.0]  # unchanged: read
    ds = ParquetDataset(str(data))
    assert len(ds) == 8
    cfg = _cfg(tmp_path, dataset=str(data), dataset_format="parquet")
    cfg.dataset_length = 8
    job = JobData(cfg.for_worker())
    job.load()  # the worker counted 8, as the driver did
    _rows(data / "a.parquet", [100, 101])
    with pytest.raises(RowsChangedError, match=r"holds 10 rows now, where 8 were counted"):
        ds.get_batch(torch.arange(2))
    with pytest.raises(ConfigError, match=r"^dataset: Parquet dataset .* holds 10 rows now, "
                                          r"where 8 were counted.*Fix: give the job a dataset "
                                          r"that stays the same"):
        job.batch(0, 0, G)


# ------------------------------------------------------------------ the evaluation set

def test_a_worker_that_reads_another_eval_dataset_length_than_the_job_refuses(tmp_path):
    """The twin of the training set's check: the driver read 16 evaluation samples; a worker
    that reads 20 (a grown directory, a factory of "latest" data) would score other batches
    than its peers (mis-paired collectives under zero3 and pipelines: a hang; mixed splits
    under dp). It refuses when it loads its data, before any step or evaluation."""
    cfg = _cfg(tmp_path, eval_dataset=RegressionData(16))
    cfg.eval_dataset_length = 16
    ok = JobData(cfg.for_worker())
    ok.load()
    assert len(ok.eval_dataset) == 16
    grown = _cfg(tmp_path, eval_dataset=RegressionData(20))
    grown.eval_dataset_length = 16
    with pytest.raises(ConfigError, match=r"eval_dataset: this worker reads 20 samples, where "
                                          r"the job read 16"):
        JobData(grown.for_worker()).load()
    with pytest.raises(ConfigError, match=r"eval_dataset: this worker reads 20"):
        _ = JobData(grown.for_worker()).eval_dataset  # (the lazy path too)


def test_the_driver_records_the_eval_length_and_workers_get_it(no_ray):
    tmp_path, seen = no_ray
    with pytest.raises(ReachedRay):
        elastic.fit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(64),
                    eval_dataset=RegressionData(12), global_batch_size=8, max_steps=2,
                    view="none", run_dir=str(tmp_path / "run"))
    cfg = seen[0]
    assert (cfg.dataset_length, cfg.eval_dataset_length) == (64, 12)
    assert cfg.for_worker().eval_dataset_length == 12
    assert cfg.replace(num_workers=2).eval_dataset_length == 12  # the same eval set: kept
    assert cfg.replace(eval_dataset=RegressionData(13)).eval_dataset_length is None


def test_an_eval_parquet_changed_between_its_count_and_its_read_names_eval_dataset(tmp_path):
    data = tmp_path / "eval.parquet"  # (a directory)
    data.mkdir()
    _rows(data / "b.parquet", list(range(8)))
    cfg = _cfg(tmp_path, eval_dataset=str(data), eval_every=0)
    cfg.eval_dataset_length = 8
    job = JobData(cfg.for_worker())
    job.load()
    _rows(data / "a.parquet", [100, 101])
    with pytest.raises(ConfigError, match=r"^eval_dataset: Parquet dataset .* holds 10 rows"):
        job.eval_batch(torch.arange(2))


# ------------------------------------------------------------------ the eval set's sample check

def _classifier() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 3))


def _parquet(path: Any, width: int = 8) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, width)).astype("float32")
    pq.write_table(pa.table({"x": pa.array(list(x), type=pa.list_(pa.float32(), width)),
                             "y": pa.array(rng.integers(0, 3, 32))}), str(path))
    return str(path)


class _Dicts:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.zeros(8), "y": 0}


def test_an_eval_parquet_of_the_wrong_width_is_refused_before_ray(no_ray):
    """Was: the length was its only check; the first evaluation failed in the workers (with
    eval_every 0: after the last step, and the completed run ended failed)."""
    tmp_path, _ = no_ray
    job = dict(model=_classifier, optimizer=adam, loss="cross_entropy", global_batch_size=8,
               max_steps=2, view="none", run_dir=str(tmp_path / "run"),
               dataset=_parquet(tmp_path / "train.parquet"), target_dtype="int64")
    narrow = _parquet(tmp_path / "narrow.parquet", width=4)
    with pytest.raises(ConfigError) as ei:
        elastic.fit(**job, eval_dataset=narrow)
    assert ei.value.field == "eval_dataset" and "(3, 4)" in str(ei.value)
    assert "narrow.parquet" in str(ei.value) and "check_sample: false" in ei.value.fix
    with pytest.raises(ConfigError) as ei:  # items the training set's form is not
        elastic.fit(**job, eval_dataset=_Dicts())
    assert ei.value.field == "eval_dataset" and "reading 3 sample(s) failed" in str(ei.value)
    with pytest.raises(ReachedRay):  # an eval set like the training set's passes
        elastic.fit(**job, eval_dataset=_parquet(tmp_path / "eval.parquet"))
    with pytest.raises(ReachedRay):  # the way out for a model the driver cannot run
        elastic.fit(**job, eval_dataset=narrow, check_sample=False)
