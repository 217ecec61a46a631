"""The live scheduler: a long-lived named Ray actor that runs many elastic jobs on a share of
a cluster (the one module of the scheduler that imports Ray).

``start(name, workers=...)`` (``elastic scheduler start``) creates the actor
``elastic-scheduler:<name>`` in the ``elastic`` namespace (detached: it outlives the process
that started it). It holds a ``SchedulerCore`` (``elastic.sched_core``): a queue and a pure
policy (``clusters.sched_policy``: fifo-static, srpt or goodput). Jobs arrive with
``submit_to`` (``elastic queue submit``, ``elastic.submit(..., scheduler=NAME)``); the actor
runs each admitted job with ``elastic.submit`` in its own process (one controller thread per
job, its workers Ray actors like any job's) and resizes it in place through the job's
``scale`` request, at a step boundary. ``elastic queue list|cancel`` read and change the queue.

The scheduler's capacity is a number of workers: each job's ``resources_per_worker`` must be
what one of those workers is (by default one CPU); the scheduler never hands out more than
``workers`` at once, whatever else runs on the cluster.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from clusters.sched_policy import POLICIES, policy_named

from .errors import ActorGoneError, ElasticError
from .ray_connect import call, dumps, kill, loads, named_actor, named_actors, start_named
from .sched_core import HISTORY_KEPT, QueuedJob, SchedulerCore, check_start, placed
from .sched_runner import ControllerRunner
from .sched_store import QueueStore, restore

__all__ = ["NAMESPACE", "SchedulerActor", "ScheduledJob", "start", "lookup", "shutdown",
           "submit_to", "placed", "list_schedulers", "info", "rows"]

NAMESPACE = "elastic"
_PREFIX = "elastic-scheduler:"


class SchedulerActor:
    """The body of the scheduler's Ray actor: the core, and a thread that ticks it every
    ``round_s`` (at once when a job arrives, ends or is cancelled)."""

    def __init__(self, name: str, workers: int, policy: str, round_s: float, resize_s: float,
                 max_wait_s: float | None, db: str | None = None, warm: int = 0) -> None:
        self.name = name
        self.pool = None  # warm workers, owned by this actor's process: they outlive jobs
        if warm:
            from .control.pool import WorkerPool

            self.pool = WorkerPool(min(warm, workers), max_idle=workers, max_total=workers)
        self.policy_name = policy
        self.round_s = round_s
        self._t0 = time.monotonic()
        self.store = QueueStore(db) if db else None
        self.hooks: dict[str, Any] = {}  # job -> its step hook (a sweep's trial), not persisted
        self._wake = threading.Event()
        self.core = SchedulerCore(policy_named(policy, resize_s=resize_s, max_wait_s=max_wait_s),
                                  workers, ControllerRunner(self.hooks, self.pool, self.now,
                                                            self._wake.set),
                                  clock=self.now,
                                  on_change=self._persist)
        self.restored = 0
        if self.store is not None:
            self.restored = restore(self.core, self.store, loads, dumps)
            self._wait_for_old_jobs()
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, name="elastic-scheduler", daemon=True)
        self._thread.start()

    def _wait_for_old_jobs(self, timeout_s: float = 30.0) -> None:
        """Jobs that were running when the previous scheduler died: their controllers died
        with it, their workers and control actors follow (Ray ends what a dead process
        owned). Wait for their names to be free before running them again (bounded)."""
        from .control import list_jobs

        again = {j.name for j in self.core.jobs.values() if j.state == "queued"}
        deadline = time.monotonic() + timeout_s
        while again & set(list_jobs()) and time.monotonic() < deadline:
            time.sleep(0.5)

    def now(self) -> float:
        """Seconds since the scheduler started (the queue's clock)."""
        return time.monotonic() - self._t0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the tick: a wake during it starts the next at once
            try:
                self.core.tick()
            except Exception as e:  # noqa: BLE001 - the loop must outlive one bad round
                self.errors.append(f"{type(e).__name__}: {e}")
            self._wake.wait(self.round_s)

    def _persist(self, j: QueuedJob) -> None:
        if self.store is not None:
            self.store.update(j.name, j.state, j.row())

    def submit(self, cfg: Any, hook: Any = None) -> str:
        """Queue ``cfg``; ``hook`` (a ``StepHook``, e.g. a sweep trial's pruner)
        runs beside the job's controller in this process."""
        keep = None
        if self.store is not None:  # stored before a tick can start it (was: after: a tick
            if not cfg.name:  # between started it, then its row was written queued)
                cfg = cfg.replace(name=cfg.job_name)  # (as the core names it)
            keep = functools.partial(self._stored, dumps(cfg))  # (pickled outside its lock)
        name = self.core.submit(cfg, keep=keep)
        if hook is not None:
            self.hooks[name] = hook
            hook.open_soon()  # a trial's pruner: its study opened while queued
        self._wake.set()
        return name

    def _stored(self, blob: bytes, j: QueuedJob) -> None:
        assert self.store is not None
        self.store.add(j.name, blob, time.time())

    def cancel(self, job: str) -> str:
        before = self.core.cancel(job)
        if before == "queued":  # its hook (a trial's pruner, its study opened) is not needed
            self.hooks.pop(job, None)
        self._wake.set()
        return before

    def rows(self) -> list[dict[str, Any]]:
        return self.core.rows()

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "policy": self.policy_name, "workers": self.core.capacity,
                "decisions": self.core.decisions, "now_s": self.now(), "errors": self.errors[-5:],
                "db": self.store.path if self.store is not None else None,
                "restored": self.restored,
                "pool": self.pool.info() if self.pool is not None else None}

    def result(self, job: str) -> dict[str, Any] | None:
        """A job that ended: its state, error, steps and final parameters; None if it has
        not ended. The final parameters are handed out once (the scheduler keeps no ended
        job's model): a later call has ``state_dict`` None (its checkpoints have them)."""
        j: QueuedJob | None = self.core.jobs.get(job)
        if j is None:
            raise ElasticError(f"no job named {job!r} in scheduler {self.name!r}")
        if j.state in ("queued", "running"):
            return None
        res = j.result
        if res is not None:
            res.read = True
        taken = res is not None and res.taken
        params = res.take_params() if res is not None else None
        out = {"state": j.state, "error": j.error, "row": j.row(),
               "steps": j.step if res is not None else 0,  # (a resumed job's: all its steps)
               "history": list(res.history) if res is not None else [],
               "state_dict": params, "run_dir": res.run_dir if res is not None else None,
               "params_taken": taken, "history_dropped": res.dropped if res is not None else 0}
        notes = []
        if taken:
            notes.append("the final parameters were handed out by an earlier result() call "
                         "(the scheduler keeps no ended job's model); its checkpoints hold them")
        if res is not None and res.dropped:
            where = f"{res.run_dir}/metrics.jsonl" if res.run_dir else "its run directory's metrics.jsonl"
            notes.append(f"the history holds only the job's last step: the scheduler keeps "
                         f"{HISTORY_KEPT} steps of ended jobs' histories in all, newest jobs "
                         f"first; every step is in {where}")
        if notes:
            out["note"] = "; ".join(notes)
        return out

    def shutdown(self) -> None:
        """Stop the loop and every running job (each at a step boundary)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        self.core.wait_resizes(timeout=300)
        running = [j.handle for j in list(self.core.jobs.values()) if j.state == "running"]
        for h in running:
            try:
                self.core.runner.stop(h)
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass
        deadline = time.monotonic() + 300  # the stops are posted: each job's end waited for
        while (any(not self.core.runner.done(h) for h in running)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        if self.pool is not None:
            self.pool.close()


def _actor_name(name: str) -> str:
    return _PREFIX + name


def list_schedulers() -> list[str]:
    return named_actors(NAMESPACE, _PREFIX)


def lookup(name: str = "default") -> Any:
    """The running scheduler's actor handle; ``ElasticError`` naming the fix otherwise."""
    h = named_actor(_actor_name(name), NAMESPACE)
    if h is None:
        have = list_schedulers()
        raise ElasticError(
            f"no elastic scheduler named {name!r} on this cluster"
            f" ({'running: ' + ', '.join(have) if have else 'none is running'}). Fix: start one "
            f"with `elastic scheduler start --name {name}`")
    return h


def start(name: str = "default", *, workers: int, policy: str = "srpt", round_s: float = 2.0,
          resize_s: float = 10.0, max_wait_s: float | None = 1800.0, detached: bool = True,
          db: str | None = None, warm: int = 0) -> Any:
    """Start the scheduler ``name`` owning ``workers`` workers; refuses a name in use or an
    unknown policy. Returns its actor handle. Ray must be initialised (``ray_connect``).

    ``db``: a SQLite file (on the node that starts it) holding the queue: a scheduler started
    again with the same file takes its jobs back (``elastic.sched_store``); None: in memory
    only. ``elastic scheduler start`` uses ``~/.elastic/scheduler-<name>.sqlite``.

    ``warm``: worker processes (of one CPU, or the shape jobs ask for) the scheduler keeps
    up between its jobs (``elastic.control.pool.WorkerPool``, owned by the scheduler's
    process, at most ``workers`` of them): a job admitted while one is free reaches its
    first step without starting a process."""
    check_start(workers, round_s, resize_s, max_wait_s, warm)
    if policy not in POLICIES:
        raise ElasticError(f"unknown scheduling policy {policy!r}. Fix: use one of "
                           f"{', '.join(POLICIES)}")
    if name in list_schedulers():
        raise ElasticError(f"a scheduler named {name!r} is already running. Fix: use it, or "
                           f"`elastic scheduler stop --name {name}` first")
    return start_named(SchedulerActor, _actor_name(name), NAMESPACE, name, workers, policy,
                       round_s, resize_s, max_wait_s, db, warm, detached=detached)


def info(name: str = "default") -> dict[str, Any]:
    """The scheduler's name, policy, workers, decisions so far and recent loop errors."""
    return dict(call(lookup(name).info))


def rows(name: str = "default") -> list[dict[str, Any]]:
    """Every job the scheduler holds (``elastic queue list``)."""
    return list(call(lookup(name).rows))


def shutdown(name: str = "default") -> None:
    """Stop the scheduler's running jobs at a step boundary, then end its actor."""
    h = lookup(name)
    call(h.shutdown)
    kill(h)


class ScheduledJob:
    """The SDK's handle on a job submitted to a scheduler."""

    def __init__(self, scheduler: str, job: str) -> None:
        self.scheduler = scheduler
        self.job = job

    def status(self) -> dict[str, Any]:
        """The job's row in ``elastic queue list``; ``ElasticError`` for a job the scheduler
        does not hold (was: a bare ``StopIteration``, found by a new user, session 48)."""
        for r in rows(self.scheduler):
            if r["job"] == self.job:
                return r
        raise ElasticError(f"scheduler {self.scheduler!r} holds no job {self.job!r}. Fix: "
                           "check the name (elastic queue list)")

    def cancel(self) -> str:
        """Cancel the job (queued: at once; running: stopped at a step boundary). Returns
        its state before; ``ElasticError`` for a job the scheduler does not hold."""
        return str(call(lookup(self.scheduler).cancel, self.job))

    def done(self) -> bool:
        return self.status()["state"] not in ("queued", "running")

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the job to end: its state, error, steps and final parameters. A
        scheduler that goes away meanwhile (restarted on its queue file, which takes its jobs
        back) is waited for up to ``RESTART_WAIT_S``, then ``ElasticError`` naming the fix.
        Was: its dead handle's error ended the caller (a sweep: every trial after it)."""
        h = lookup(self.scheduler)
        deadline = None if timeout is None else time.monotonic() + timeout
        gone: float | None = None  # since when the scheduler has been away
        while True:
            try:
                out = call(h.result, self.job)
                gone = None
            except ActorGoneError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.job!r}: its scheduler {self.scheduler!r} "
                                       "went away and is not back") from None
                gone = gone if gone is not None else time.monotonic()
                if time.monotonic() - gone > RESTART_WAIT_S:
                    raise ElasticError(
                        f"scheduler {self.scheduler!r} went away while job {self.job!r} was in "
                        f"it and was not back within {RESTART_WAIT_S:.0f}s. Fix: start it again "
                        "with the same queue file (--db), which takes its jobs back; then "
                        "resume what waited on it (a sweep: run it again)") from None
                time.sleep(1.0)
                try:
                    h = lookup(self.scheduler)
                except ElasticError:
                    pass  # not back yet
                continue
            if out is not None:
                return dict(out)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job!r} is still {self.status()['state']}")
            time.sleep(0.5)


RESTART_WAIT_S = 600.0  # how long a job's result waits for its scheduler to come back


def submit_to(scheduler: str, cfg: Any, hook: Any = None) -> ScheduledJob:
    """Queue ``cfg`` (a ``JobConfig``) in the running scheduler ``scheduler``; ``hook``: a
    picklable ``elastic.control.hooks.StepHook`` its controller gets (a sweep trial's pruner:
    ``elastic.sweep.trial_steps.ScheduledHook``)."""
    return ScheduledJob(scheduler, str(call(lookup(scheduler).submit, placed(cfg), hook)))

