"""Ray Data as a job's dataset.

A ``ray.data.Dataset`` given as ``dataset`` or ``eval_dataset`` (or, with ``dataset_format:
ray``, an import string or factory of one, called on the driver once Ray is up) is executed
once, on the cluster, into Arrow blocks in Ray's object store. Workers read the rows of their
share straight from those blocks: ``input_column`` and ``target_column``, as Parquet is read.

Why execute it whole rather than stream it (Ray Train's ``iter_torch_batches``): the samples
of step s depend only on (seed, s, G) (``elastic.data``), whatever the world size, failures or
switches. A streaming split cannot re-read step s after a node loss or re-cut it when the
world changes; a table of blocks is random access, so the sampler picks rows and any rank
takes any rows. The pipeline's order is fixed: a copy of the dataset runs with
``preserve_order`` on, so the same (deterministic) pipeline gives the same rows in the same
order in every run, and a resumed job sees the samples the first run would have seen.

Memory: the blocks stay in the object store while the job runs (owned by the driver). A worker
fetches the blocks its samples are in and keeps them (zero-copy on its node; the workers of
one node share one copy), so with a random order each node ends up holding the dataset once.
Small neighbouring blocks are joined first (``merge_groups``): a batch costs one gather per
block it touches.
A block on a lost node is rebuilt by Ray from its lineage (a task: it needs a free CPU).
docs/architecture.md, "Data", has the decisions and what is not done.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clusters.pool_policy import PoolKey

from .config.datasets import is_ray_dataset
from .data import column_array
from .errors import ClusterError, ConfigError

if TYPE_CHECKING:
    from .config import JobConfig

__all__ = ["PoolRoom", "RayBlocks", "is_ray_dataset", "materialize", "prepare", "data_key"]


class RayBlocks:
    """A map-style dataset over a materialized Ray dataset's Arrow blocks: (input, target)
    rows from two columns. Picklable (the block references travel, never the tables); not
    thread-safe."""

    by_columns = True  # errors name input_column/target_column, as for Parquet

    def __init__(self, refs: list[Any], rows: list[int], columns: tuple[str, str],
                 dtypes: tuple[str, str], name: str = "") -> None:
        self.refs = list(refs)
        self.rows = [int(n) for n in rows]
        self.columns = columns
        self.dtypes = dtypes
        self.name = name
        self._ends = np.cumsum(np.asarray(self.rows, dtype=np.int64))
        self._tables: dict[int, Any] = {}
        self._arrays: dict[int, tuple[Any, Any]] = {}
        self._shapes: tuple[Any, Any] | None = None  # each column's row shape (first block)
        self.key: Any = None  # the pipeline these came from (data_key), where one ran them

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_tables"], d["_arrays"] = {}, {}
        return d

    def forget(self) -> None:
        """Drop the blocks this process fetched (the driver's check read a few rows: kept,
        they would pin their blocks for as long as the job, or its sweep, holds these)."""
        self._tables.clear()
        self._arrays.clear()

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __repr__(self) -> str:
        return f"RayBlocks({self.name or 'ray.data.Dataset'}: {len(self)} rows, {len(self.refs)} blocks)"

    def _fetch(self, blocks: list[int]) -> None:
        need = [b for b in blocks if b not in self._tables]
        if need:
            from .ray_connect import get_ref

            for b, table in zip(need, get_ref([self.refs[b] for b in need]), strict=True):
                self._tables[b] = table

    def _block_arrays(self, b: int) -> tuple[Any, Any]:
        """Block ``b``'s two columns as numpy arrays (views of the object store's copy where
        Arrow allows: no copy per worker), made once per block."""
        got = self._arrays.get(b)
        if got is None:
            t = self._tables[b]
            got = (column_array(t, self.columns[0], self.dtypes[0]),
                   column_array(t, self.columns[1], self.dtypes[1]))
            self._same_shapes(b, (got[0].shape[1:], got[1].shape[1:]))
            self._arrays[b] = got
        return got

    def _same_shapes(self, b: int, shapes: tuple[Any, Any]) -> None:
        """Block ``b``'s row shapes must be the first block's (a gather would broadcast a
        width of 1 without a word)."""
        if self._shapes is None:
            self._shapes = shapes
        for col, have, want in zip(self.columns, shapes, self._shapes, strict=True):
            if tuple(have) != tuple(want):
                raise ValueError(f"column {col!r} of the Ray dataset has rows of shape "
                                 f"{tuple(have)} in block {b} and {tuple(want)} in an earlier "
                                 "one: every row must have the same shape")

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``indices`` (in that order), as (inputs, targets): the rows of each block
        gathered with one numpy index into preallocated outputs."""
        idx = indices.numpy().astype(np.int64, copy=False)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range for {self!r}")
        if not len(idx):
            self._fetch([0])
            xa, ya = self._block_arrays(0)
            return torch.from_numpy(xa[:0].copy()), torch.from_numpy(ya[:0].copy())
        blk = np.searchsorted(self._ends, idx, side="right")
        order = np.argsort(blk, kind="stable")  # positions, grouped by block
        cuts = np.flatnonzero(np.diff(blk[order])) + 1
        present = [int(b) for b in blk[order][np.r_[0, cuts]]]
        self._fetch(present)
        out_x = out_y = None
        for b, where in zip(present, np.split(order, cuts), strict=True):
            xa, ya = self._block_arrays(b)
            local = idx[where] - (int(self._ends[b]) - self.rows[b])
            if out_x is None or out_y is None:
                out_x = np.empty((len(idx), *xa.shape[1:]), dtype=xa.dtype)
                out_y = np.empty((len(idx), *ya.shape[1:]), dtype=ya.dtype)
            out_x[where] = xa[local]
            out_y[where] = ya[local]
        assert out_x is not None and out_y is not None
        return torch.from_numpy(out_x), torch.from_numpy(out_y)

    def head(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_batch(torch.arange(min(n, len(self))))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([int(i)]))
        return x[0], y[0]


class PoolRoom:
    """Room for a pipeline on a cluster whose CPUs a ``WorkerPool``'s idle workers hold: one
    idle worker is retired (the pool's policy picks the longest idle, "room for a job"), and
    the pool starts no refill until ``done``. Idle workers are a cache; the pipeline is the
    job's own."""

    KEY = PoolKey.of({"CPU": 1}, False, {"elastic": "a Ray Data pipeline"})  # no worker's

    def __init__(self, pool: Any, wait_s: float = 10.0) -> None:
        self.pool, self.wait_s, self.held = pool, wait_s, 0

    def make(self) -> bool:
        """Retire one idle worker and wait (``wait_s`` at most) for its CPU; False when the
        pool has none idle, or no CPU came free."""
        from .ray_connect import free_cpus

        if self.pool is None or not self.pool.info()["idle"]:
            return False
        self.pool.take(self.KEY, 1, 0)  # hands out nothing: retires one for the room
        self.held += 1
        deadline = time.monotonic() + self.wait_s
        while free_cpus() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return free_cpus() >= 1

    def done(self) -> None:
        if self.pool is not None and self.held:
            self.pool.cold_placed(self.held)
            self.held = 0


def materialize(ds: Any, field: str, columns: tuple[str, str], dtypes: tuple[str, str],
                room: PoolRoom | None = None) -> RayBlocks:
    """Run ``ds`` (in its own order) into the object store; ``ConfigError`` naming the field
    when the pipeline fails or lacks a column, ``ClusterError`` when Ray does. With no CPU
    free, ``room`` may make one."""
    from .ray_connect import free_cpus

    if not _cpu_comes_free(free_cpus) and not (room is not None and room.make()):
        # (a materialized dataset too: its blocks are counted and joined by 1-CPU tasks)
        raise ClusterError(  # Ray Data's tasks would wait for a CPU, silently, for ever
            f"{field}: the Ray dataset's pipeline needs a free CPU to run on, and the cluster "
            "has none free (workers or other jobs hold them all; a WorkerPool's idle workers "
            "give theirs; a materialized dataset needs one too, to count and join its "
            "blocks). Fix: free a CPU: add a node, or run fewer workers beside the job")
    run = _own_copy(ds)  # the job's blocks go with the job; the user's dataset is untouched
    opts = run.context.execution_options
    kept_order = opts.preserve_order
    try:
        opts.preserve_order = True
        refs = run.to_arrow_refs()
        schema = run.schema()
    except Exception as e:  # noqa: BLE001 - the user's pipeline (or Ray): say which
        if _ray_fault(e):
            raise ClusterError(f"{field}: Ray failed while running the dataset's pipeline: "
                               f"{type(e).__name__}: {str(e).strip()[:300]}") from e
        raise ConfigError(field, f"running the Ray dataset failed: {_user_error(e)}.",
                          "fix the pipeline (ds.take(1) on the driver shows the whole "
                          "traceback)") from None
    finally:
        if run is ds:
            opts.preserve_order = kept_order
    names = list(schema.names) if schema is not None else []
    for setting, col in zip(("input_column", "target_column"), columns, strict=True):
        if schema is not None and col not in names:
            raise ConfigError(setting, f"{col!r} is not a column of the Ray dataset "
                              f"({field}); it has {names}.",
                              f"set {setting} to one of them, or add the column in the pipeline")
    try:
        refs, rows = _joined(refs)
    except Exception as e:
        if _ray_fault(e):
            raise ClusterError(f"{field}: Ray failed while counting or joining the dataset's "
                               f"blocks: {type(e).__name__}: {str(e).strip()[:300]}") from e
        raise
    return RayBlocks(refs, rows, columns, dtypes, name=getattr(ds, "_dataset_name", None) or "")


def _joined(refs: list[Any]) -> tuple[list[Any], list[int]]:
    """The blocks' references and row counts, empty blocks dropped and runs of small ones
    joined (``merge_groups``). Until the joins end the object store holds both copies of the
    small blocks; the originals go when the last reference here does."""
    from .ray_connect import join_tables, table_sizes

    sizes = table_sizes(refs)
    kept = [(r, n, b) for r, (n, b) in zip(refs, sizes, strict=True) if n]
    refs, rows = [r for r, _, _ in kept], [n for _, n, _ in kept]
    groups = merge_groups([b for _, _, b in kept])
    if len(groups) < len(refs):  # small blocks, end to end: fewer, larger ones
        joined = iter(join_tables([[refs[i] for i in g] for g in groups if len(g) > 1]))
        out_refs, out_rows = [], []
        for g in groups:
            one = next(joined) if len(g) > 1 else None
            if one is None:  # a single block, or blocks that do not join: as they are
                out_refs += [refs[i] for i in g]
                out_rows += [rows[i] for i in g]
            else:
                out_refs.append(one)
                out_rows.append(sum(rows[i] for i in g))
        refs, rows = out_refs, out_rows
    return refs, rows


MERGE_BYTES = 16 << 20  # blocks smaller than this are joined with their neighbours


def merge_groups(nbytes: list[int], target: int | None = None) -> list[list[int]]:
    """Runs of neighbouring blocks (by index, in order) of at most ``target`` bytes
    (``MERGE_BYTES``; 0: none joined) together;
    a block of ``target`` or more is a run of its own. A batch's rows are gathered per block
    (a numpy index each), so 400 blocks of 32 KiB cost a step ~290 Python-level gathers; one
    block of 13 MiB costs one. Ray Data's small blocks come from its read and repartition
    settings, not from the data."""
    target = MERGE_BYTES if target is None else target
    groups: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        if run and size + b > target:
            groups.append(run)
            run, size = [], 0
        run.append(i)
        size += b
    if run:
        groups.append(run)
    return groups


CPU_WAIT_S = 3.0  # a pipeline's tasks that just ended give their CPUs back a moment later


def _cpu_comes_free(free_cpus: Callable[[], float]) -> bool:
    """Whether a CPU is free now or within ``CPU_WAIT_S`` (the job's previous pipeline, or a
    job that just ended, may still hold one: the eval set's pipeline saw none, 1 run in 5)."""
    deadline = time.monotonic() + CPU_WAIT_S
    while free_cpus() < 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _own_copy(ds: Any) -> Any:
    """A copy of ``ds`` with its own context and cache (``Dataset.copy``, deep), so that the
    blocks it runs into are the job's alone and its ``preserve_order`` is set on the copy;
    ``ds`` itself where this Ray has no such copy."""
    try:
        return type(ds).copy(ds, _deep_copy=True)
    except Exception:  # noqa: BLE001 - another Ray's signature: run the user's object
        return ds


def _ray_fault(e: BaseException) -> bool:
    """Whether Ray itself failed (a lost object or node, memory), not the user's code: Ray's
    own exceptions other than a task error wrapping the user's."""
    return (type(e).__module__.startswith("ray.exceptions") and "TaskError" not in
            type(e).__name__ and "UserCode" not in type(e).__name__)


def _user_error(e: BaseException) -> str:
    """The user's exception, as "Type: message", from under Ray's wrappers. A task's error
    reaches the driver as text (Ray's ``RayTaskError`` keeps the remote traceback, not the
    exception), so its first "...Error: ..." line is the user's; for display only."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    for line in text.splitlines():
        m = re.match(r"([A-Za-z_][\w.]*(?:Error|Exception)): (.+)", line.strip())
        if m and not m.group(1).startswith("ray."):
            return f"{m.group(1)}: {m.group(2)[:300]}"
    first = (text.strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def prepare(cfg: JobConfig, model: Any, emit: Callable[..., Any] | None = None,
            pool: Any = None) -> dict[str, RayBlocks]:
    """On the driver, once Ray is up: the job's Ray datasets as blocks (by field), checked
    as preflight checks other datasets (enough rows; the model and loss on a sample). Each
    run is a ``data`` event (rows, blocks, seconds). ``model`` None: no checks (a sweep's
    run, checked by each trial's job against its own model). ``pool``: the job's ``WorkerPool``,
    whose idle workers give up a CPU for the pipeline when none is free. Blocks already in
    ``cfg.ray_blocks`` (a sweep's, run once for its trials) are used as they are."""
    room = PoolRoom(pool)
    try:
        return _prepare(cfg, model, emit, room)
    finally:
        room.done()


def _prepare(cfg: JobConfig, model: Any, emit: Callable[..., Any] | None,
             room: PoolRoom) -> dict[str, RayBlocks]:
    from .control.preflight import check_dataset_object

    data = cfg.data
    columns, dtypes = (data.input_column, data.target_column), (data.input_dtype,
                                                                data.target_dtype)
    out: dict[str, RayBlocks] = {}
    for field, given in (("dataset", data.dataset), ("eval_dataset", cfg.eval_dataset)):
        if given is None or not (data.format == "ray" or is_ray_dataset(given)):
            continue
        ran = cfg.ray_blocks.get(field)
        if ran is not None and getattr(ran, "key", None) == data_key(cfg):  # run once
            # already, for every trial of a sweep with this very pipeline: checked for
            out[field] = ran  # this job's model and loss
            if emit is not None:
                epochs, again = _epochs(cfg, field, len(ran))
                emit("data", f"{field}: reads the {len(ran)} rows in {len(ran.refs)} blocks "
                     f"its sweep ran the Ray dataset into{again}", data={
                         "field": field, "rows": len(ran), "blocks": len(ran.refs),
                         "seconds": 0.0, "shared": True, "epochs": epochs})
            if model is not None:
                check_dataset_object(cfg, model, field, ran)
                ran.forget()
            continue
        ds = cfg.dataset_object() if field == "dataset" else cfg.eval_dataset_object()
        if not is_ray_dataset(ds):  # a factory of a map-style dataset: workers call it too
            if model is not None:
                check_dataset_object(cfg, model, field, ds)
            continue
        t0 = time.monotonic()
        out[field] = blocks = materialize(ds, field, columns, dtypes, room)
        blocks.key = data_key(cfg)
        secs = time.monotonic() - t0
        if emit is not None:
            epochs, again = _epochs(cfg, field, len(blocks))
            emit("data", f"{field}: ran the Ray dataset into {len(blocks)} rows in "
                 f"{len(blocks.refs)} blocks in {secs:.1f}s{again}",
                 data={"field": field, "rows": len(blocks), "blocks": len(blocks.refs),
                       "seconds": round(secs, 3), "epochs": epochs})
        if model is not None:
            check_dataset_object(cfg, model, field, blocks)
            blocks.forget()
    return out


def _epochs(cfg: JobConfig, field: str, rows: int) -> tuple[int, str]:
    """How many times the job reads ``rows`` rows, and what its ``data`` event adds when the
    training set is read more than once (the pipeline ran once)."""
    epochs = -(-cfg.max_steps * cfg.data.global_batch_size // max(1, rows))
    return epochs, (f"; the job reads its rows {epochs} times (epochs), and the pipeline ran "
                    "once: randomness in it (augmentation) was drawn once, so every epoch "
                    "sees the same rows" if field == "dataset" and epochs > 1 else "")


def data_key(cfg: JobConfig) -> Any:
    """What makes two jobs' Ray datasets the same pipeline (its setting, format, columns and
    dtypes, for ``dataset`` and ``eval_dataset``), so a sweep runs it once for its trials;
    None when the job has no Ray dataset. A dataset object is keyed by its identity."""
    import json

    data = cfg.data
    if not any(g is not None and (data.format == "ray" or is_ray_dataset(g))
               for g in (data.dataset, cfg.eval_dataset)):
        return None

    def one(g: Any) -> str:
        if isinstance(g, (str, dict, list)):
            return json.dumps(g, sort_keys=True, default=repr)
        return f"object {id(g)}"
    return (tuple(one(g) if g is not None else "" for g in (data.dataset, cfg.eval_dataset)),
            data.format, data.input_column, data.target_column, data.input_dtype,
            data.target_dtype)
