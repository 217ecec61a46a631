"""Warm workers: a pool of worker processes handed from job to job.

A worker's process costs seconds to start (a Python interpreter, torch, the job's code, on a
GPU host CUDA's context): what a short job or a sweep's trial pays on every start. A
``WorkerPool`` keeps worker actors that are up, each in a placement group of one bundle that
holds its resources while it is idle, and hands them to jobs: a job started with
``elastic.submit(cfg, pool=pool)`` (or ``fit``, or by a scheduler started with ``warm=``)
takes idle workers of its resource shape, device kind and runtime environment (its
``PoolKey``) and starts cold only the ones missing, in one-bundle groups of their own so
that they, too, can join the pool. When the job ends, each of its workers is reset
(``Worker.reset``: the group destroyed, the job's components and tensors dropped, the job's
modules unloaded, the environment restored, garbage collected, CUDA's cache emptied) and
kept or retired as ``clusters.pool_policy.PoolPolicy`` decides (a worker whose job failed in
user code is retired, never handed out again). A worker that died while idle is found by a
ping before any hand-out, and never handed out; nor is one on a node Ray is draining (a
preemption notice): it is retired at the next hand-out or give-back, or by the pool's own
watch (``maintain``, every ``maintain_every_s``), which also retires idle workers that died
or idled too long and refills the pool, between jobs. What the next job can and cannot see
of the previous one: docs/scheduler.md, "Warm workers".

Ownership: Ray ends an actor with the process that created it (unless detached), so the
pool's workers live as long as the process that holds the pool: the driver for the SDK's
pool, the scheduler's actor for its own. The jobs that use a pool run in that process
(``submit``, ``fit`` and the scheduler's controllers do), so their workers outlive them.

Thread-safe: jobs of one process may take and give back workers at the same time. The Ray
calls go through ``elastic.ray_connect``; this module decides and keeps the books.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusters.pool_policy import (
    ROOM,
    ROOM_HOLD_S,
    IdleWorker,
    PoolDecision,
    PoolKey,
    PoolObservation,
    PoolPolicy,
    Returned,
    Room,
    Want,
    fitting,
)

from ..errors import ClusterError
from ..ray_connect import (
    actor_key,
    connect,
    disconnect,
    draining_nodes,
    get_ref,
    kill,
    new_bundle,
    pg_ready,
    ray_session,
    remove_bundle,
    runtime_env_now,
    start_in_bundle,
    wait_refs,
    worker_bundle,
)
from .group import WorkerRec
from .pool_watch import start_watch

log = logging.getLogger(__name__)

__all__ = ["WorkerPool", "default_pool"]

_DEFAULT: list[WorkerPool] = []  # the pool this process's jobs use when given none
_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()  # this process's open pools
_LIVE_LOCK = threading.Lock()  # pools are made and closed from any thread
PLACING_S = 5.0  # a refill's group not placed this long after its start waits for room


def default_pool() -> WorkerPool | None:
    """The pool that jobs started in this process take warm workers from when they are given
    none (``WorkerPool.make_default``); None when there is none, it was closed, or it was
    made in another Ray connection than this process has now (its handles mean nothing)."""
    pool = _DEFAULT[0] if _DEFAULT else None
    now = ray_session()
    if pool is not None and now is not None and pool._session != now:
        return None
    return pool


@dataclass
class _Proc:
    """A worker process the pool knows: idle, lent to a job, or starting."""

    handle: Any
    pg: Any
    key: PoolKey
    node: str = ""
    pid: int = 0
    jobs: int = 0
    idle_since: float = 0.0  # (while starting: when it was started)
    ref: Any = None  # while starting: its info call


@dataclass
class PoolStats:
    started: int = 0  # processes the pool started (ahead of demand, or cold for a job)
    handed_out: int = 0  # warm hand-outs
    cold: int = 0  # workers a pooled job had to start
    kept: int = 0
    retired: dict[str, int] = field(default_factory=dict)  # reason -> count


class WorkerPool:
    """Worker processes kept up between jobs (see the module docstring).

    ``size``: workers of the pool's own shape (``resources_per_worker``, ``use_gpu``: None
    decides as a job's placement does, GPU workers on a cluster with GPUs,
    ``runtime_env``) started ahead of demand and kept idle; ``max_idle``: the most kept idle
    (default ``max(size, 8)``); ``max_total``: the most the pool's workers may number, idle,
    lent and starting (what it starts ahead of demand stays within it; default ``size``, so
    a pool does not start more while its workers are out); ``idle_timeout_s``,
    ``max_jobs``: a worker idle longer (beyond the pool's own ``size``), or that served that
    many jobs, is retired. ``wait``: block until the first ``size`` workers are up;
    ``maintain_every_s``: how often the pool's own watch runs ``maintain`` (None: only when
    a job takes or gives back). Ray must be initialised, or is started here for ``size``
    workers (``ray_address`` as a job's) and shut down by ``close``. Close a pool before
    ``ray.shutdown()``: a watch between its check and a Ray call would start a new Ray.
    """

    def __init__(self, size: int = 0, *, resources_per_worker: dict[str, float] | None = None,
                 use_gpu: bool | None = None, runtime_env: dict[str, Any] | None = None,
                 max_idle: int | None = None, max_total: int | None = None,
                 idle_timeout_s: float = 600.0, max_jobs: int = 100,
                 ray_address: str | None = None, wait: bool = True,
                 maintain_every_s: float | None = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if maintain_every_s is not None and not maintain_every_s > 0:
            raise ValueError(f"maintain_every_s={maintain_every_s!r}: give seconds > 0, or "
                             "None for no watch")
        cpus = float((resources_per_worker or {}).get("CPU", 1))
        self._started_ray = connect(ray_address, max(size, 1) * cpus, log.warning)
        # as a job's placement decides: a pool of CPU workers on a GPU cluster matched no job
        res, use_gpu = worker_bundle(dict(resources_per_worker or {"CPU": 1}), use_gpu)
        self.bundle = res
        self.use_gpu = use_gpu
        self.runtime_env = dict(runtime_env or {})
        self.env = self.runtime_env or runtime_env_now()
        self.key = PoolKey.of(res, use_gpu, self.env)
        self.policy = PoolPolicy(self.key, min_idle=size, max_idle=max(size, 8)
                                 if max_idle is None else max_idle,
                                 max_total=max_total if max_total is not None else size or None,
                                 idle_timeout_s=idle_timeout_s, max_jobs=max_jobs)
        self.clock = clock
        self.stats = PoolStats()
        self._lock = threading.RLock()
        # held by a whole ``maintain`` round (its Ray calls are outside ``_lock``): ``close``
        # and the exit wait for it, since a Ray call after Ray's shutdown starts a new Ray
        self._round = threading.Lock()
        self._idle: dict[str, _Proc] = {}
        self._lent: dict[str, _Proc] = {}
        self._starting: dict[str, _Proc] = {}
        self._closed = False
        self._cold_pending = 0  # left to start cold by hand-outs, not placed yet
        self._room_until = float("-inf")  # no refill before (room made for another pool)
        self.start_error = ""  # why the last worker that failed to start failed
        self._ix: dict[int, _Proc] = {}
        self._apply(self.policy.decide(self._observe()))
        self._session = ray_session()
        self._stop = threading.Event()
        if wait and size:
            try:
                self.wait_ready()
            except BaseException:  # the caller gets no pool to close: its workers go now
                self.close()
                raise
        if maintain_every_s and self._session is not None:
            start_watch(self, self._stop, self._round, maintain_every_s)
        with _LIVE_LOCK:
            _LIVE.add(self)

    # ------------------------------------------------------------------ public

    def wait_ready(self, timeout_s: float | None = 120.0) -> int:
        """Wait for the workers starting to be up; returns the idle count. ``ClusterError``
        when none could start (the last start error)."""
        with self._lock:
            refs = [p.ref for p in self._starting.values()]
        wait_refs(refs, timeout_s)
        with self._lock:
            self._settle()
            if refs and not self._idle and self.start_error:
                raise ClusterError(f"the pool's workers failed to start: {self.start_error}. "
                                   "Fix: check the pool's runtime_env and resources")
            return len(self._idle)

    def info(self) -> dict[str, Any]:
        """Counts (idle by key, lent, starting) and what the pool did so far."""
        with self._lock:
            self._settle()
            by_key: dict[str, int] = {}
            for p in self._idle.values():
                by_key[p.key.describe()] = by_key.get(p.key.describe(), 0) + 1
            s = self.stats
            return {"idle": len(self._idle), "idle_by_key": by_key, "lent": len(self._lent),
                    "starting": len(self._starting), "started": s.started,
                    "handed_out": s.handed_out, "cold": s.cold, "kept": s.kept,
                    "retired": dict(s.retired),
                    "idle_pids": sorted(p.pid for p in self._idle.values())}

    def maintain(self) -> bool:
        """Decide between jobs: idle workers that died, sit on a node Ray is draining, or
        idled past ``idle_timeout_s`` (beyond the pool's own ``size``) are retired, and the
        pool refills to ``size`` (on nodes that are not draining: Ray places no new bundle
        there). One ping per idle worker and one GCS call, outside the pool's lock (jobs
        take and give back meanwhile). False, doing nothing, once the pool is closed or
        this process has left the Ray the pool was made in (its handles mean nothing in
        the next)."""
        with self._round:
            with self._lock:
                if self._closed or self._stop.is_set() or ray_session() != self._session:
                    return False
                self._settle()
                procs = list(self._idle.values())
            alive, draining = self._ping(procs), self._draining()
            with self._lock:  # idle workers taken meanwhile are no longer observed
                if self._closed or self._stop.is_set():
                    return False
                self._apply(self.policy.decide(self._observe(alive=alive, draining=draining)))
            return True

    def make_default(self) -> WorkerPool:
        """Make this the pool of every job started in this process without one (``fit``,
        ``submit``, a sweep's trials): a notebook's or a test session's jobs in a row then
        reuse their worker processes. Until ``close``; returns the pool."""
        _DEFAULT[:] = [self]
        return self

    def close(self) -> None:
        """Kill the idle and starting workers and release their bundles (lent workers end
        with their jobs: given back to a closed pool, they are retired). No longer the
        default pool, if it was."""
        if _DEFAULT and _DEFAULT[0] is self:
            _DEFAULT.clear()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self._stop.set()
        # the round in progress ends first (bounded: a GCS that is gone must not hold it up)
        waited = self._round.acquire(timeout=5.0)
        try:
            with self._lock:
                self._closed = True
                for p in list(self._idle.values()) + list(self._starting.values()):
                    self._kill(p)
                self._idle, self._starting = {}, {}
            if self._started_ray:
                disconnect()
        finally:
            if waited:
                self._round.release()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ for placements

    def take(self, key: PoolKey, n: int, free_bundles: int = 0,
             free: Mapping[str, Mapping[str, float]] | None = None,
             wait_s: float = 0.0) -> list[_Proc]:
        """Up to ``n`` idle workers of ``key``, each pinged first (a dead one is retired,
        never handed out); idle workers of other keys are retired when the cluster has no
        room for the ones that must start cold, and then, for what is still missing, those
        of the other pools of this process (``make_room``). ``free``: each node's free
        resources, by node id (how many bundles fit and what the cold ones lack are counted
        from it), else ``free_bundles``: how many bundles of ``key`` fit. The
        caller says ``cold_placed`` for those once it has placed them (or given up): until
        then the pool starts no refill. ``wait_s``: how long to wait for the pool's workers
        of ``key`` still starting (refills) that the idle ones fall short by; they hold the
        room a cold start would wait for (after a job whose every worker was retired, the
        next one found none idle, and its cold workers waited out their placement timeout
        for CPUs the refills held)."""
        if wait_s > 0 and key == self.key:  # (placed, or just started: one whose group
            # still waits for room would hold a job's boundary for the whole wait)
            with self._lock:
                lack = n - sum(p.key == key for p in self._idle.values())
                starting = list(self._starting.values())[:max(0, lack)]
                now = self.clock()
            wait_refs([p.ref for p in starting
                       if now - p.idle_since < PLACING_S or pg_ready(p.pg)], wait_s)
        with self._lock:
            self._settle()
            alive = self._ping(list(self._idle.values()))
            per_node = tuple(sorted(
                (str(node), tuple(sorted((r, float(v)) for r, v in f.items())))
                for node, f in free.items())) if free else None
            if per_node is not None:
                free_bundles = fitting(key, per_node)
            d = self.policy.decide(self._observe(alive=alive, want=Want(key, n, free_bundles,
                                                                        per_node),
                                                 draining=self._draining()))
            out = [self._ix[i] for i in d.hand_out]
            for p in out:
                a = actor_key(p.handle)
                del self._idle[a]
                self._lent[a] = p
            self.stats.handed_out += len(out)
            self._apply(d)
            self._cold_pending += max(0, n - len(out))
        short = d.room_short  # (outside this pool's lock: the others take theirs)
        with _LIVE_LOCK:
            others = [p for p in _LIVE if p is not self]
        for other in others:
            if not short:
                break
            try:
                short = other.make_room(short)
            except Exception as e:  # noqa: BLE001 - the job's own placement goes on (and
                # says what it lacks if it times out); the workers handed out stay its
                log.warning("pool could not make room for another pool's job: %r", e)
        return out

    def make_room(self, need: Room) -> Room:
        """Retire idle workers, longest idle first, that hold some of ``need`` (resources a
        job of another pool of this process lacks: its workers must start cold and find none
        free); returns what is still lacking. Nothing once the pool is closed or from
        another Ray."""
        with self._lock:
            if not need or self._closed or ray_session() != self._session:
                return need
            self._settle()
            d = self.policy.decide(self._observe(room=need))
            self._apply(d)
            if any(why == ROOM for _, why in d.retire):
                self._room_until = self.clock() + ROOM_HOLD_S
            return d.room_short

    def reserve_cold(self, n: int) -> None:
        """``n`` more workers a job is about to start cold (warm ones that failed to take
        it): no refill until ``cold_placed``."""
        with self._lock:
            self._cold_pending += max(0, n)

    def cold_placed(self, n: int) -> None:
        """``n`` workers a hand-out left to start cold are placed, or will not be."""
        with self._lock:
            self._cold_pending = max(0, self._cold_pending - n)

    def adopt(self, handle: Any, pg: Any, key: PoolKey) -> None:
        """A worker a pooled job started cold: lent to it from now on."""
        with self._lock:
            self._lent[actor_key(handle)] = _Proc(handle, pg, key)
            self.stats.cold += 1
            self.stats.started += 1

    def give_back(self, recs: Sequence[WorkerRec], lost: Sequence[str] = ()) -> None:
        """Workers a job is done with: each is reset (in parallel, bounded) and kept or
        retired. ``lost``: actor ids of workers it lent out that the job killed or lost."""
        with self._lock:
            for a in lost:
                self._lent.pop(a, None)
            procs = [p for w in recs if (p := self._lent.get(actor_key(w.handle)))]
            for w in recs:
                p = self._lent.get(actor_key(w.handle))
                if p is not None:
                    p.node = str(w.info.get("node_id", p.node))
                    p.pid = int(w.info.get("pid", p.pid))
        refs = [p.handle.reset.remote() for p in procs]
        wait_refs(refs, 30.0)
        reports = []
        for p, ref in zip(procs, refs, strict=True):
            try:
                out = get_ref(ref, 0)
                p.jobs = int(out["jobs"])
                # a spare that never joined its job has no info yet: its reset says
                p.pid, p.node = int(out.get("pid") or p.pid), str(out.get("node_id") or p.node)
                reports.append(Returned(0, p.key, p.node, True, bool(out["ok"]),
                                        bool(out["user_error"]), int(out["threads"]), p.jobs,
                                        bool(out.get("segment_ran")),
                                        int(out.get("cuda_left") or 0)))
            except Exception:  # noqa: BLE001 - dead, or did not reset in time: retired
                reports.append(Returned(0, p.key, p.node, alive=False, reset_ok=False))
        with self._lock:
            for p in procs:
                self._lent.pop(actor_key(p.handle), None)
            d = self.policy.decide(self._observe(returned=list(zip(procs, reports, strict=True)),
                                                 draining=self._draining()))
            for i in d.keep:
                p = self._ix[i]
                if self._closed:
                    self._kill(p)
                    continue
                p.idle_since = self.clock()
                self._idle[actor_key(p.handle)] = p
                self.stats.kept += 1
            self._apply(d)

    # ------------------------------------------------------------------ the books

    def _observe(self, alive: dict[str, bool] | None = None,
                 returned: Sequence[tuple[_Proc, Returned]] = (),
                 want: Want | None = None,
                 draining: frozenset[str] = frozenset(), room: Room = ()) -> PoolObservation:
        """The policy's view; ``self._ix`` maps the ids it uses back to processes (idle
        ones first, then the returned ones)."""
        self._ix = {}
        idle = []
        for a, p in self._idle.items():
            i = len(self._ix)
            self._ix[i] = p
            idle.append(IdleWorker(i, p.key, p.node, p.idle_since, p.jobs,
                                   (alive or {}).get(a, True)))
        rets = []
        for p, r in returned:
            i = len(self._ix)
            self._ix[i] = p
            rets.append(dataclasses.replace(r, id=i))
        return PoolObservation(self.clock(), tuple(idle), tuple(rets), want,
                               lent=len(self._lent), starting=len(self._starting),
                               draining=draining, cold_pending=self._cold_pending, room=room,
                               room_held=self.clock() < self._room_until)

    @staticmethod
    def _draining() -> frozenset[str]:
        """The nodes Ray is draining (one GCS call); none when the GCS does not answer (a
        worker there is then found by the job's own notice watch)."""
        try:
            return frozenset(draining_nodes())
        except Exception:  # noqa: BLE001 - the GCS busy or going: no notice seen
            return frozenset()

    def _apply(self, d: PoolDecision) -> None:
        """Retire and start what ``d`` says (ids of the last observation)."""
        for i, why in d.retire:
            p = self._ix[i]
            self._idle.pop(actor_key(p.handle), None)
            self._kill(p)
            self.stats.retired[why] = self.stats.retired.get(why, 0) + 1
        if self._closed:
            return
        for _ in range(d.start):
            pg = new_bundle(self.bundle)
            h = self._start_blank(pg, 0)
            self._starting[actor_key(h)] = _Proc(h, pg, self.key, ref=h.info.remote(),
                                                 idle_since=self.clock())
            self.stats.started += 1

    def _start_blank(self, pg: Any, slot: int, bundle: dict[str, float] | None = None,
                     use_gpu: bool | None = None) -> Any:
        """A worker process with no job yet, in bundle ``slot`` of ``pg`` (of ``bundle``'s
        shape: default the pool's own)."""
        from ..worker import Worker

        bundle = self.bundle if bundle is None else bundle
        gpu = self.use_gpu if use_gpu is None else use_gpu
        threads = int(bundle.get("CPU", 1))
        return start_in_bundle(Worker, (None, -1, gpu, threads, None), bundle, pg, slot,
                               self.runtime_env or None)

    def _settle(self) -> None:
        """Starting workers that are up become idle; those that failed are dropped."""
        if not self._starting:
            return
        ready, _ = wait_refs([p.ref for p in self._starting.values()], 0)
        done = {id(r) for r in ready}
        for a, p in list(self._starting.items()):
            if id(p.ref) not in done:
                continue
            del self._starting[a]
            try:
                info = get_ref(p.ref, 0)
            except Exception as e:  # noqa: BLE001 - said by wait_ready and info
                lines = str(e).strip().splitlines()
                self.start_error = lines[-1][:300] if lines else type(e).__name__
                self._kill(p)
                continue
            p.ref, p.node, p.pid = None, str(info["node_id"]), int(info["pid"])
            p.idle_since = self.clock()
            self._idle[a] = p

    def _ping(self, procs: list[_Proc], timeout_s: float = 2.0) -> dict[str, bool]:
        """Whether each idle worker answers (its process lives) within ``timeout_s``."""
        refs = [p.handle.info.remote() for p in procs]
        wait_refs(refs, timeout_s)
        out = {}
        for p, ref in zip(procs, refs, strict=True):
            try:
                get_ref(ref, 0)
                out[actor_key(p.handle)] = True
            except Exception:  # noqa: BLE001 - dead or hung: not handed out
                out[actor_key(p.handle)] = False
        return out

    @staticmethod
    def _kill(p: _Proc) -> None:
        try:
            kill(p.handle)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if p.pg is not None:
            remove_bundle(p.pg)

