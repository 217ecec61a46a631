"""The worker group: the controller's only Ray-aware code.

``WorkerGroup`` owns the job's worker actors and their placement: it reserves bundles, starts
workers (or warm spares), forms each generation of the group, kills workers, watches Ray's
draining nodes, and makes every call to them (``calls.py``). What Ray raises becomes elastic's
typed errors here: the controller runs without Ray over ``tests/unit/fake_group.py``.

Not thread-safe except ``request_stop`` (the SDK's thread, while the controller's waits on a
segment; its Ray calls go through ``teller.Teller``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import ClusterError, ElasticError, InfrastructureError, WorkerError, WorkerLostError
from ..failures import Failure, classify
from ..ray_connect import (
    bundle_node,
    node_alive,
    pg_ready,
    remove_bundle,
    resources_free,
    wait_refs,
    worker_bundle,
)
from .calls import EVEN, PlacementCalls, WorkerCalls
from .drains import NodeDrains
from .group import DrainNotice, Segment, SegmentPoll, WorkerRec, capacity
from .liveness import Liveness
from .steps import HANG_SLACK_S
from .teller import Teller
from .watch import SegmentWatch

__all__ = ["WorkerGroup", "Placement", "WorkerRec", "Segment", "SegmentPoll"]


def _typed(e: BaseException, w: WorkerRec | None = None) -> BaseException:
    """Ray's wrappers turned into elastic's errors: a worker's own typed error comes through
    as it was raised; a dead actor is a ``WorkerLostError``."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, ElasticError):
            return cause
        return InfrastructureError(str(e).strip().splitlines()[-1][:500] if str(e) else
                                   type(e).__name__)
    if isinstance(e, RayActorError):
        rank = w.rank if w is not None else None
        node = str(w.info.get("node_id", "")) if w is not None else ""
        lost = bool(getattr(e, "preempted", False)) or (bool(node) and not node_alive(node))
        return WorkerLostError(f"worker rank {rank} died{' with its node' if lost else ''}: "
                               f"{str(e).strip().splitlines()[0][:200] if str(e) else ''}",
                               rank=rank, node_lost=lost)
    return e


class Placement:
    """Where the job's workers run: its placement groups, the bundles without a worker
    (free slots), and the spares starting in the background. Returns the workers it starts;
    ``WorkerGroup`` takes them in."""

    def __init__(self, config: Any, emulate: Sequence[dict[str, Any]] | None = None,
                 liveness: tuple[str, int, str] | None = None) -> None:
        self.cfg = config
        self._liveness = liveness  # (host, port, token) each worker connects to
        self.use_gpu = False
        self.start_error = ""  # why the last worker that failed to start failed
        self._emulate = list(emulate or [])
        self._next_id = 0
        self.free_slots: list[tuple[Any, int]] = []  # reserved bundles without a worker
        self.draining: list[tuple[Any, int, str]] = []  # bundles of a draining node's workers
        self._drained: set[str] = set()  # nodes Ray was seen draining (``revive``)
        self.lost: list[tuple[Any, int, str]] = []  # of workers lost with a node Ray holds alive
        self._warming: list[tuple[WorkerRec, Any]] = []  # spares starting: (worker, info ref)
        self._bundle_res: dict[str, float] | None = None
        self._worker_cfg = config.for_worker()  # what a worker reads, and nothing else

    def bundle(self) -> dict[str, float]:
        """One worker's resources (GPU jobs get ``num_gpus=1`` and NCCL)."""
        if self._bundle_res is None:
            self._bundle_res, self.use_gpu = worker_bundle(
                dict(self.cfg.resources_per_worker), self.cfg.use_gpu)
        return dict(self._bundle_res)

    def place(self, n: int, min_workers: int) -> list[WorkerRec]:
        """Reserve ``n`` bundles in one placement group and start one worker in each;
        ``ClusterError`` with the fix if they cannot be reserved in time or fewer than
        ``min_workers`` start."""
        import ray
        from ray.util.placement_group import placement_group

        bundle = self.bundle()
        if self.cfg.placement == "per_worker":  # a shrink can give each bundle back
            pgs = [placement_group([dict(bundle)]) for _ in range(n)]
        else:
            pgs = [placement_group([dict(bundle) for _ in range(n)], strategy="PACK")]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs),
                            timeout=self.cfg.placement_timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise ClusterError(
                f"the cluster cannot host {n} workers of {bundle} within "
                f"{self.cfg.placement_timeout_s:.0f}s ("
                f"{capacity(bundle, ray.cluster_resources(), ray.available_resources())}). "
                "Fix: lower num_workers or resources_per_worker, or add nodes.")
        launched = (self._launch(pgs[0], list(range(n)), bundle) if len(pgs) == 1 else
                    [x for pg in pgs for x in self._launch(pg, [0], bundle)])
        new = self._collect(launched, wait_s=None)
        if len(new) < min_workers:
            raise ClusterError(
                f"only {len(new)} of {n} workers started (min_workers={min_workers}); "
                f"a worker failed to start: {self.start_error}. Fix: check that the job's "
                "code imports and its factories run on the cluster's nodes.")
        return new

    def _launch(self, pg: Any, slots: list[int], bundle: dict[str, float]
                ) -> list[tuple[WorkerRec, Any]]:  # in bundles ``slots`` of ``pg``, not waited for
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..worker import Worker

        remote_cls: Any = ray.remote(Worker)
        new = []
        for i in slots:
            wid = self._next_id
            self._next_id += 1
            h = remote_cls.options(
                num_cpus=bundle.get("CPU", 1), num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                max_concurrency=2, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i),
            ).remote(self._worker_cfg, wid, self.use_gpu, int(bundle.get("CPU", 1)),
                     self._liveness)
            new.append((WorkerRec(h, wid, pg=pg, slot=i), h.info.remote()))
        return new

    def _collect(self, launched: list[tuple[WorkerRec, Any]], wait_s: float | None
                 ) -> list[WorkerRec]:
        """Take launched workers that are up (within ``wait_s``; None: wait for all) into
        the job; the others are killed and their slots freed."""
        import ray

        refs = [ref for _, ref in launched]
        if wait_s is not None and refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        up = []
        for w, ref in launched:
            try:
                w.info = ray.get(ref, timeout=0 if wait_s is not None else None)
                up.append(w)
            except Exception as e:  # noqa: BLE001 - any start failure frees the slot
                lines = str(e).strip().splitlines()  # the worker's own error comes last
                self.start_error = lines[-1][:500] if lines else type(e).__name__
                _kill(w)
                self.free_slots.append((w.pg, w.slot))
        if self._emulate and up:
            emus = self._emulate
            infos = ray.get([w.handle.set_emulation.remote(emus[w.worker_id % len(emus)])
                             for w in up])
            for w, info in zip(up, infos, strict=True):
                w.info = info
        return up

    def spares_ready(self) -> int:
        """Warm spares that are up (their info answered; one that failed to start is not)."""
        import ray

        refs = [ref for _, ref in self._warming]
        done = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        return sum(_error_of(r) is None for r in done)

    def spares_starting(self) -> int:
        return len(self._warming)

    def warming(self) -> list[WorkerRec]:
        return [w for w, _ in self._warming]

    def start_spares(self, n: int) -> None:
        """Start up to ``n`` workers in the background where there is room (a free reserved
        slot that Ray re-reserved, or free resources for one more); they join at a step
        boundary once up (``take_spares``)."""
        import ray
        from ray.util.placement_group import placement_group

        if n <= 0:
            return
        bundle = self.bundle()
        self.revive()
        ready_slots = [(pg, i) for pg, i in self.free_slots if pg_ready(pg)][:n]
        for pg, i in ready_slots:
            self.free_slots.remove((pg, i))
            self._warming += self._launch(pg, [i], bundle)
        if n > len(ready_slots) and not ready_slots and resources_free(bundle):
            pg = placement_group([dict(bundle)])
            ok, _ = ray.wait([pg.ready()], timeout=1.0)
            if ok:
                self._warming += self._launch(pg, [0], bundle)
            else:
                ray.util.remove_placement_group(pg)

    def take_spares(self, n: int) -> list[WorkerRec]:
        """Up to ``n`` warm spares that are up (spares that failed to start are dropped,
        their slots freed); the rest keep warming."""
        import ray

        if n <= 0 or not self._warming:
            return []
        refs = [ref for _, ref in self._warming]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_ids = {id(r) for r in done}
        finished = [(w, r) for w, r in self._warming if id(r) in done_ids][:n]
        taken = {id(w) for w, _ in finished}
        self._warming = [(w, r) for w, r in self._warming if id(w) not in taken]
        return self._collect(finished, wait_s=0)

    def try_place(self, n: int, timeout_s: float) -> list[WorkerRec]:
        """Place up to ``n`` more workers within ``timeout_s``: the job's free slots first (Ray
        re-reserves a dead node's bundle where there is room), then new placement groups."""
        from ray.util.placement_group import placement_group

        if n <= 0 or timeout_s <= 0:
            return []
        deadline = time.monotonic() + timeout_s
        while self.lost and time.monotonic() < deadline:  # until Ray, too, holds them dead
            time.sleep(0.05)
            self.revive()
        bundle = self.bundle()
        placed: list[WorkerRec] = []
        reuse, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        while reuse:
            on = {(id(pg), i): bundle_node(pg, i) for pg, i in reuse}
            by_pg: dict[int, tuple[Any, list[int]]] = {}
            for pg, idx in reuse:
                by_pg.setdefault(id(pg), (pg, []))[1].append(idx)
            for pg, idxs in by_pg.values():
                placed += self._collect(self._launch(pg, idxs, bundle),
                                        wait_s=max(0.5, deadline - time.monotonic()))
            # a worker that failed to start as its bundle's node had died (lost unannounced
            # with it, before Ray held it dead) starts again in the same bundle, which Ray
            # reserves again where there is room (a new group would wait behind it)
            reuse = [(pg, i) for pg, i in self.free_slots
                     if on.get((id(pg), i)) and not node_alive(on[(id(pg), i)])]
            if not reuse or time.monotonic() >= deadline:
                break
            self.free_slots = [s for s in self.free_slots if s not in reuse]
            time.sleep(0.1)
        pgs = [placement_group([dict(bundle)]) for _ in range(n - len(placed) - len(reuse))]
        tried: set[tuple[int, int]] = set()
        while pgs and not all(map(pg_ready, pgs)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the job's own bundle that Ray re-reserved on a node that joined
            self.revive()  # (a draining node's, once gone) holds the room a new group waits
            for pg, i in [s for s in self.free_slots if pg_ready(s[0])]:
                idle = next((g for g in pgs if not pg_ready(g)), None)  # for: taken instead
                if idle is not None and (id(pg), i) not in tried:  # (a failed start puts
                    tried.add((id(pg), i))  # its slot back: not taken again here)
                    pgs.remove(idle)
                    remove_bundle(idle)
                    self.free_slots.remove((pg, i))
                    placed += self._collect(self._launch(pg, [i], bundle), wait_s=30)
        for pg in pgs:
            if pg_ready(pg):
                placed += self._collect(self._launch(pg, [0], bundle), wait_s=30)
            else:
                remove_bundle(pg)
        return placed

    def revive(self) -> None:
        """Free slots: a lost node's bundles once it is gone; a draining node's once it is gone
        or drains no more after Ray had it draining (a refused drain's stay held: no spare)."""
        from ..ray_connect import draining_nodes
        try:  # the GCS not answering: no bundle of a live node freed
            now = set(draining_nodes()) if self.draining else set()
        except Exception:  # noqa: BLE001 - asked again at the next call
            now = {d[2] for d in self.draining}
        self._drained |= now  # (a notice that did not come true: drained, then not)
        for name in ("draining", "lost"):
            gone = [d for d in getattr(self, name) if not node_alive(d[2])
                    or (name == "draining" and d[2] in self._drained - now)]
            setattr(self, name, [d for d in getattr(self, name) if d not in gone])
            self.free_slots += [(pg, i) for pg, i, _ in gone]

    def room(self) -> bool:
        """A free reserved slot that is placeable, or free resources for one more worker."""
        self.revive()
        if self.free_slots:
            return any(pg_ready(pg) for pg, _ in self.free_slots)
        return resources_free(self.bundle())

    def vacate(self, gone: Sequence[WorkerRec], kept: Sequence[WorkerRec]) -> None:
        """Kill the workers a shrink removed; a placement group no kept worker or spare uses
        is removed (back to the cluster), a bundle of a shared one becomes a free slot."""
        used = {id(w.pg) for w in kept} | {id(w.pg) for w, _ in self._warming}
        dropped: set[int] = set()
        for w in gone:
            _kill(w)
            if w.pg is None or id(w.pg) in dropped:
                continue
            if id(w.pg) in used:
                self.free_slots.append((w.pg, w.slot))
                continue
            dropped.add(id(w.pg))
            remove_bundle(w.pg)
        self.free_slots = [(pg, i) for pg, i in self.free_slots if id(pg) not in dropped]

    def release(self, extra: Sequence[WorkerRec]) -> None:
        """Kill every spare and the job's workers ``extra``; release every placement group."""
        warm = [w for w, _ in self._warming]
        self._warming = []
        for w in warm + list(extra):
            _kill(w)
        pgs = ([w.pg for w in list(extra) + warm] + [pg for pg, _ in self.free_slots]
               + [pg for pg, _, _ in self.draining + self.lost])
        for pg in {id(pg): pg for pg in pgs if pg is not None}.values():
            remove_bundle(pg)
        self.free_slots, self.draining, self.lost = [], [], []


class WorkerGroup(PlacementCalls, WorkerCalls):
    """The job's workers on a Ray cluster (Ray must be initialised): placement (through
    ``Placement``), membership, and every call to them."""

    def __init__(self, config: Any, emulate: Sequence[dict[str, Any]] | None = None,
                 placement: Any = None) -> None:
        """``placement``: how the workers are placed, made as ``placement(config, emulate,
        liveness)``; default ``Placement`` (a ``WorkerPool``'s jobs: ``PooledPlacement``)."""
        self.cfg = config
        self.workers: list[WorkerRec] = []
        self.generation = 0
        import ray

        self.liveness = Liveness(ray.util.get_node_ip_address(), config.heartbeat_timeout_s)
        self.watch = SegmentWatch(self.liveness, self._answers)
        self.placement = (placement or Placement)(
            config, emulate, (*self.liveness.address, self.liveness.token))
        self.drains = NodeDrains()  # Ray's drains of the job's nodes
        self._teller = Teller()  # ``_tell`` from threads other than the job's
        self.hung: list[WorkerRec] = []  # ended as hung in a call, not yet removed

    def _answers(self, w: WorkerRec) -> bool:
        """Whether a silent worker answers a ping within 1 s (its second thread)."""
        import ray
        try:
            return ray.get(w.handle.progress.remote(), timeout=1.0) is not None
        except Exception:  # noqa: BLE001 - dead or unresponsive
            return False

    # ------------------------------------------------------------------ membership

    def form(self) -> tuple[str, int, float]:
        """Form the next generation of the group over ``workers`` (ranks in list order);
        returns (address, port, seconds)."""
        self.generation += 1
        for r, w in enumerate(self.workers):
            w.rank = r
            w.info["rank"] = r
        head = self.workers[0]
        port = self._get(head.handle.free_port.remote())
        addr = head.info["ip"]
        t0 = time.perf_counter()
        self._call_each([w.handle.join.remote(addr, port, w.rank, len(self.workers),
                                            self.generation, self.cfg.hang_timeout_s)
                       for w in self.workers], self.workers, what="join")
        return addr, port, time.perf_counter() - t0

    def remove(self, dead: Sequence[WorkerRec]) -> None:
        """Drop ``dead`` from the job: kill them; their bundles become free slots (``lost``)."""
        for w in dead:
            _kill(w)
            if self.liveness.node_lost(w.worker_id):
                self.placement.lost.append((w.pg, w.slot, str(w.info.get("node_id", ""))))
            else:
                self.placement.free_slots.append((w.pg, w.slot))
        gone = {id(w) for w in dead}
        self.workers = [w for w in self.workers if id(w) not in gone]
        self.hung = [w for w in self.hung if id(w) not in gone]

    def release(self, workers: Sequence[WorkerRec]) -> None:
        """Let workers of a draining node go (killed now); their bundles become free slots
        only once the node is gone or drains no more (``Placement.revive``)."""
        for w in workers:
            _kill(w)
            self.placement.draining.append((w.pg, w.slot, str(w.info.get("node_id", ""))))
        gone = {id(w) for w in workers}
        self.workers = [w for w in self.workers if id(w) not in gone]
        self.liveness.forget([w.worker_id for w in workers])

    # ------------------------------------------------------------------ notices

    def notices(self) -> list[DrainNotice]:
        return self.drains.notices(self.workers)

    def drain_node(self, node_id: str, deadline_s: float | None, message: str) -> str:
        return self.drains.request(node_id, deadline_s, message)

    def shrink(self, n: int) -> list[WorkerRec]:
        """Keep the first ``n`` workers; kill the rest (``Placement.vacate``: their bundles
        go back to the cluster where no kept worker shares their placement group, else
        become free slots). Returns the removed."""
        extra = self.workers[n:]
        self.workers = self.workers[:n]
        self.placement.vacate(extra, self.workers)
        return extra

    def survivors(self, exclude: Sequence[WorkerRec] = ()) -> tuple[list[WorkerRec],
                                                                     list[WorkerRec]]:
        """Ping every worker (its second thread answers even while the first is busy)."""
        import ray

        out = list(exclude) + [w for w in self.hung if w not in exclude]  # ended: no ping
        gone = out + [w for w in self.watch.lost(self.workers) if w not in out]
        skip = {id(w) for w in gone}  # known lost (liveness): no 10 s wait on a ping
        refs = [(w, w.handle.progress.remote()) for w in self.workers if id(w) not in skip]
        alive, dead = [], gone
        for w, ref in refs:
            try:
                ray.get(ref, timeout=10)
                alive.append(w)
            except Exception:  # noqa: BLE001 - dead or unresponsive: lost either way
                dead.append(w)
        return alive, dead

    # ------------------------------------------------------------------ segments

    def start_segment(self, start: int, end: int) -> Segment:
        self.segment_id += 1  # before the calls go: a stop sent from here on names it
        futs = [w.handle.run.remote(start, end, self.segment_id) for w in self.workers]
        return Segment(start, end, list(zip(self.workers, futs, strict=True)))

    def poll_segment(self, seg: Segment, timeout_s: float) -> SegmentPoll:
        """Wait up to ``timeout_s`` for the segment, watching its futures and the workers'
        liveness (``SegmentWatch``); every failure, typed."""
        import ray

        return self.watch.poll(seg, timeout_s, wait_refs, self._failures,
                               lambda fs: int(ray.get(fs[0])["next_step"]))

    def _failures(self, seg: Segment, refs: Sequence[Any]) -> list[Failure]:
        import ray

        ids = {id(r) for r in refs}
        out = []
        for w, f in seg.running:
            if id(f) not in ids:
                continue
            try:
                ray.get(f, timeout=0)
            except Exception as e:  # noqa: BLE001 - typed below
                out.append(classify(_typed(e, w), rank=w.rank))
        return out

    def wind_down(self, seg: Segment, timeout_s: float) -> list[WorkerRec]:
        """``SegmentWatch.wind_down``: the ranks hung in their segment after a failure."""
        return self.watch.wind_down(seg, timeout_s, wait_refs, lambda w: w.handle.leave.remote())

    def _tell(self, method: str, *args: Any) -> None:
        """Fire and forget, thread-safe: ``method`` on every worker (``Teller``)."""
        self._teller.call(_tell_all, list(self.workers), method, args)

    def drain(self) -> list[list[dict[str, Any]]]:
        """Each worker's metrics since the last drain (empty for one that does not answer
        within 5 s, or lost: failure handling takes over); a worker's user error is raised."""
        import ray

        refs = [w.handle.drain.remote() for w in self.workers]
        answered = {id(refs[i]) for i in self.watch.gather(refs, self.workers, 5.0, wait_refs)}
        out: list[list[dict[str, Any]]] = []
        for w, ref in zip(self.workers, refs, strict=True):
            if id(ref) not in answered:
                out.append([])
                continue
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - typed below
                err = _typed(e, w)
                if isinstance(err, WorkerError):
                    raise err from None
                out.append([])
        return out

    # ------------------------------------------------------------------ typed calls (how
    # the calls ``WorkerCalls`` names travel, and how their failures come back)

    def checkpoint_poll(self) -> list[dict[str, Any] | None]:
        """Each worker's upload outcome; a worker that does not answer within 30 s counts as
        a failed upload."""
        import ray

        refs = [w.handle.checkpoint_poll.remote() for w in self.workers]
        self.watch.gather(refs, self.workers, 30.0, wait_refs)
        out: list[dict[str, Any] | None] = []
        for w, ref in zip(self.workers, refs, strict=True):
            try:  # (one that has not ended raises at once)
                out.append(ray.get(ref, timeout=0))
            except Exception:  # noqa: BLE001 - said as a failed upload
                out.append({"error": f"worker {w.rank} did not answer"})
        return out

    def checkpoint_done(self, step: int, committed: bool, generation: int | None = None,
                        seq: int | None = None) -> None:
        """Tell every worker (not waited for: each acts only on the checkpoint named)."""
        self._tell("checkpoint_done", step, committed, generation, seq)

    def final_state(self) -> dict[str, Any]:
        """The full canonical state, from rank 0 (collective over the group)."""
        outs = self._call_each([w.handle.full_state.remote(want=(w.rank == 0))
                                for w in self.workers], self.workers)
        return outs[0]

    def _call(self, method: str, *args: Any, workers: Sequence[WorkerRec] | None = None,
              timeout_s: float | None = None) -> list[Any]:
        ws = list(self.workers if workers is None else workers)
        refs = [getattr(w.handle, method).remote(*args) for w in ws]
        return self._call_each(refs, ws, timeout_s, method)

    def _call_each(self, refs: list[Any], ws: Sequence[WorkerRec],
                   timeout_s: float | None = None, what: str = "") -> list[Any]:
        """Every result, or the typed error of the lowest rank that failed (a worker that
        liveness finds lost is not waited for); an error that only echoes a peer's failure
        (``secondary``) gives way to that peer's own. A rank still inside the call when it is
        hung (``watch.hung_after``) is ended, named in a ``HangError`` (``Gathered.cause``)."""
        import ray

        hang_s = float(self.cfg.hang_timeout_s) + HANG_SLACK_S
        got = self.watch.collect(refs, ws, 1e9 if timeout_s is None else timeout_s, wait_refs,
                                 _error_of, hang_s, what in EVEN)
        for i in sorted(got.hung):
            _kill(ws[i])
            self.hung.append(ws[i])
        errors: list[BaseException] = []
        for i, (w, ref) in enumerate(zip(ws, refs, strict=True)):
            try:
                if i in got.hung:
                    raise got.hang_error(w, what, hang_s)
                if i not in got.ended:
                    raise (self.watch.lost_error(w) if self.watch.lost([w]) else
                           InfrastructureError(f"worker rank {w.rank} did not answer within "
                                               f"{timeout_s}s"))
                ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - typed
                errors.append(_typed(e, w))
        if not errors:
            return list(ray.get(refs, timeout=0))
        raise got.cause(errors) from None

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except Exception as e:  # noqa: BLE001 - typed
            raise _typed(e) from None

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill every worker and spare and release every placement group (a pool's
        placement resets its healthy workers and takes them back instead)."""
        import ray

        self.liveness.close()
        self._teller.close()
        if not ray.is_initialized():
            return
        self.placement.release(self.workers)
        self.workers = []


def _tell_all(workers: Sequence[WorkerRec], method: str, args: tuple[Any, ...]) -> None:
    for w in workers:
        try:
            getattr(w.handle, method).remote(*args)
        except Exception:  # noqa: BLE001 - a dead worker: failure handling sees it
            pass


def _error_of(ref: Any) -> BaseException | None:  # a finished call's error, typed
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception as e:  # noqa: BLE001 - typed
        return _typed(e)
    return None


def _kill(w: WorkerRec) -> None:
    import ray

    try:
        ray.kill(w.handle)
    except Exception:  # noqa: BLE001 - already gone
        pass
