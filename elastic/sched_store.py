"""The scheduler's queue on disk (SQLite), so that it survives a scheduler restart.

One row per job: its name, submission order, wall-clock submission time, state, its
serialized config (bytes the caller produced: the scheduler uses Ray's cloudpickle, so the
jobs' model factories and datasets come back as they went in) and the last ``row()`` seen
(JSON). ``restore`` turns the rows back into queue entries: a job that was queued is queued
again; one that was running when the scheduler went away lost its controller with it (the
scheduler's process ran it), so it is queued again too, marked as such, and resumes from its
newest checkpoint when its checkpoint URI holds one (``resume: latest``), else runs as
submitted (a fork from its source again, or from scratch in a new run directory), with the
steps its row last showed when it resumes (none when it starts over). That decision is
stored with it (its config, state queued): a second restart, before or while it runs again,
goes on from there. Ended jobs come back as history.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from .sched_core import QueuedJob, SchedulerCore

__all__ = ["QueueStore", "restore"]

_SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY, seq INTEGER, submitted_wall REAL, state TEXT, cfg BLOB, row TEXT)"""


class QueueStore:
    """A SQLite file holding the queue; thread-safe (one connection behind a lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:":  # it holds the jobs' configs as given, credentials included
            # (checkpoint options a restarted job needs): the owner's only, as ~/.aws's
            # files are; SQLite gives its -wal and -shm files the same mode
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            os.chmod(path, 0o600)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()

    def add(self, name: str, cfg_blob: bytes, submitted_wall: float) -> None:
        """A newly submitted job (replaces an ended one of the same name)."""
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, 'queued', ?, '{}')",
                             (name, seq, submitted_wall, cfg_blob))

    def update(self, name: str, state: str, row: dict[str, Any],
               cfg_blob: bytes | None = None) -> None:
        """A job's state and row; ``cfg_blob``: the config it runs (again) with, if new."""
        with self._lock:
            self._db.execute("UPDATE jobs SET state = ?, row = ?, cfg = COALESCE(?, cfg) "
                             "WHERE name = ?", (state, json.dumps(_jsonable(row)), cfg_blob,
                                                name))

    def load(self) -> list[tuple[str, float, str, bytes, dict[str, Any]]]:
        """(name, submitted_wall, state, cfg blob, last row), in submission order."""
        with self._lock:
            cur = self._db.execute(
                "SELECT name, submitted_wall, state, cfg, row FROM jobs ORDER BY seq")
            return [(n, w, s, bytes(c), json.loads(r or "{}")) for n, w, s, c, r in cur]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def _rerun(cfg: Any) -> Any:
    """The config that runs an interrupted job again: when its own checkpoint URI holds a
    committed checkpoint, it resumes from the newest (``resume: latest``, same run
    directory), whatever it was submitted with (a fork goes on from its own steps, not the
    source's again); else as submitted when it resumes from somewhere, else it starts over
    in a new numbered run directory (``<run dir>.rerun<N>``: the interrupted run's logs stay
    where they were). A storage that cannot be listed: ``resume: latest``, which says why
    when the job starts (never a start over the checkpoints there)."""
    from .checkpoint import committed_steps
    from .checkpoint_io import job_store
    from .errors import CheckpointError

    try:
        mine = bool(committed_steps(job_store(cfg)))
    except CheckpointError:
        mine = True
    if mine:
        return cfg if cfg.resume == "latest" else cfg.replace(resume="latest")
    if cfg.resume:
        return cfg
    base = re.sub(r"\.rerun\d+$", "", cfg.run_path)  # (a re-run's own re-run: the next N)
    n = 1
    while os.path.exists(f"{base}.rerun{n}"):
        n += 1
    return cfg.replace(run_dir=f"{base}.rerun{n}")


def restore(core: SchedulerCore, store: QueueStore, loads: Callable[[bytes], Any],
            dumps: Callable[[Any], bytes]) -> int:
    """Put the stored jobs back into ``core`` (see the module docstring); ``loads`` turns a
    config blob back into a config, ``dumps`` a config into one. Returns how many were queued
    again. A config that no longer loads (its code moved) comes back as a failed job naming
    why."""
    now_wall, now = time.time(), core.clock()
    queued = 0
    for name, wall, state, blob, row in store.load():
        submitted = now - (now_wall - wall)
        try:
            cfg = loads(blob)
        except Exception as e:  # noqa: BLE001 - one bad entry must not lose the queue
            j = QueuedJob(name, None, submitted, state="failed",
                          error=f"its config no longer loads after the restart: {e}")
            core.jobs[name] = j
            continue
        step = int(row.get("step") or 0)
        if state == "running":
            cfg = _rerun(cfg)
            step = step if cfg.resume == "latest" else 0  # (else it starts over)
        if state in ("queued", "running"):
            j = QueuedJob(name, cfg, submitted, step=step)
            j.reason = ("queued again: it was running when the scheduler stopped"
                        if state == "running" else "queued again after a scheduler restart")
            if state == "running":  # stored as it runs again: a second restart goes on from
                store.update(name, "queued", j.row(), dumps(cfg))  # there (was: its first
                # config)
            queued += 1
        else:
            j = QueuedJob(name, cfg, submitted, state=state, reason=row.get("reason") or state,
                          error=row.get("error"), step=step,
                          resizes=int(row.get("resizes") or 0))
            j.let_go()
        core.jobs[name] = j
    return queued
