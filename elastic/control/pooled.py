"""A job's placement through a ``WorkerPool`` (``elastic.control.pool``): the pool keeps the
processes and their books; this is one job's side of it, warm workers taken first, the rest
started cold so that they can join the pool, all given back when the job lets them go."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from clusters.pool_policy import PoolKey

from ..ray_connect import actor_key, free_by_node, remove_bundle, wait_refs
from .group import WorkerRec
from .pool import WorkerPool, _Proc
from .worker_group import Placement

__all__ = ["PooledPlacement"]

# the most a placement waits for the pool's workers still starting (a worker's start: ~3-5 s
# of importing torch and the job's code; its bundle is held meanwhile)
STARTING_WAIT_S = 30.0


class PooledPlacement(Placement):
    """A job's placement through a ``WorkerPool``: warm workers first, the rest started
    cold (blank, then assigned, each in a one-bundle group of its own, so that it can join
    the pool); at the job's end, or when a shrink lets a worker go, the pool takes its
    workers back instead of killing them. Workers lost or released from a draining node are
    killed as usual, and never come back."""

    def __init__(self, pool: WorkerPool, config: Any, emulate: Sequence[dict[str, Any]] | None,
                 liveness: tuple[str, int, str] | None) -> None:
        if config.placement != "per_worker":  # each worker's bundle must be its own
            config = config.replace(placement="per_worker")
        super().__init__(config, emulate, liveness)
        self.pool = pool
        # the pool's workers this job holds: actor id -> (handle, placement group)
        self._mine: dict[str, tuple[Any, Any]] = {}

    def _key(self) -> PoolKey:
        return PoolKey.of(self.bundle(), self.use_gpu, self.pool.env)

    def _assign(self, handle: Any, pg: Any, warm: bool) -> tuple[WorkerRec, Any]:
        wid = self._next_id
        self._next_id += 1
        self._mine[actor_key(handle)] = (handle, pg)
        return (WorkerRec(handle, wid, info={"warm": warm}, pg=pg, slot=0),
                handle.assign.remote(self._worker_cfg, wid, self._liveness))

    def _warm(self, n: int, wait_s: float = 0.0) -> list[tuple[WorkerRec, Any]]:
        """Up to ``n`` idle workers of this job's key, assigned to it (not waited for; the
        pool's still starting ones within ``wait_s``). The ``n - len(result)`` left to start
        cold hold the pool's refill back until the caller's ``cold_placed``."""
        if n <= 0:
            return []
        bundle = self.bundle()
        procs = self.pool.take(self._key(), n, free=free_by_node(bundle), wait_s=wait_s)
        try:
            return [self._assign(p.handle, p.pg, True) for p in procs]
        except BaseException:
            self.pool.cold_placed(n - len(procs))
            # those never handed the job (the one whose assign raised is in ``_mine``: given
            # back at the job's end) go back now: nobody else holds them
            rest = [p for p in procs if actor_key(p.handle) not in self._mine]
            if rest:
                self.pool.give_back([WorkerRec(p.handle, -1, pg=p.pg) for p in rest])
            raise

    def _collect(self, launched: list[tuple[WorkerRec, Any]], wait_s: float | None
                 ) -> list[WorkerRec]:
        warm = {id(w) for w, _ in launched if w.info.get("warm")}
        up = super()._collect(launched, wait_s)
        for w in up:
            w.info["warm"] = id(w) in warm
        return up

    def _launch(self, pg: Any, slots: list[int], bundle: dict[str, float]
                ) -> list[tuple[WorkerRec, Any]]:
        out = []
        for i in slots:
            h = self.pool._start_blank(pg, i, bundle, self.use_gpu)
            # a lost worker's bundle taken over: the books no longer tie it to the lost one,
            # whose end (release) would otherwise remove it under the new worker, wherever
            # that worker is by then (given back early by a shrink, lent to another job)
            self._mine = {a: (hh, None if p is pg else p) for a, (hh, p) in self._mine.items()}
            self.pool.adopt(h, pg, self._key())
            rec, ref = self._assign(h, pg, False)
            rec.slot = i
            out.append((rec, ref))
        return out

    def _drop_failed(self, launched: list[tuple[WorkerRec, Any]], up: list[WorkerRec]
                     ) -> int:
        """Warm workers that failed to take the job (its code does not import there, ...):
        ``_collect`` killed them; their one-bundle groups are removed too, and the pool
        forgets them. Kept as free slots, those bundles held the CPUs that the cold workers
        started next needed: the job waited out its placement timeout, then said the
        cluster was too small instead of why the workers failed."""
        ok = {id(w) for w in up}
        lost = []
        for w, _ in launched:
            if id(w) in ok:
                continue
            a = actor_key(w.handle)
            lost.append(a)
            self._mine.pop(a, None)
            self.free_slots = [(pg, i) for pg, i in self.free_slots if pg is not w.pg]
            remove_bundle(w.pg)
        if lost:  # they start cold instead: their room is held before it is freed
            self.pool.reserve_cold(len(lost))
            self.pool.give_back([], lost=lost)
        return len(lost)

    @contextmanager
    def _warm_first(self, n: int, wait_s: float | None) -> Iterator[list[WorkerRec]]:
        """Up to ``n`` warm workers that took the job (those that failed to are dropped);
        the pool's refill stays held back for the rest, which the block starts cold."""
        launched = self._warm(n, STARTING_WAIT_S if wait_s is None else min(wait_s,
                                                                           STARTING_WAIT_S))
        pending = max(0, n - len(launched))
        try:
            warm = self._collect(launched, wait_s=wait_s)
            pending += self._drop_failed(launched, warm)
            yield warm
        finally:
            self.pool.cold_placed(pending)

    def place(self, n: int, min_workers: int) -> list[WorkerRec]:
        with self._warm_first(n, None) as warm:
            if len(warm) >= n:
                return warm
            try:
                cold = super().place(n - len(warm), max(0, min_workers - len(warm)))
            except BaseException:  # the warm ones go back (they were kept out of the pool's
                # books and held their bundles for good: the next jobs could not be placed)
                for w in warm:
                    self._mine.pop(actor_key(w.handle), None)
                self.pool.give_back(warm)
                raise
            return warm + cold

    def start_spares(self, n: int) -> None:
        warm = self._warm(n)
        self._warming += warm
        try:
            super().start_spares(n - len(warm))
        finally:
            self.pool.cold_placed(max(0, n - len(warm)))

    def try_place(self, n: int, timeout_s: float) -> list[WorkerRec]:
        with self._warm_first(n, max(timeout_s, 1.0)) as warm:
            return warm + super().try_place(n - len(warm), timeout_s)

    def room(self) -> bool:
        return bool(self.pool.info()["idle_by_key"].get(self._key().describe())) or super().room()

    def vacate(self, gone: Sequence[WorkerRec], kept: Sequence[WorkerRec]) -> None:
        back = [w for w in gone if actor_key(w.handle) in self._mine]
        for w in back:
            self._mine.pop(actor_key(w.handle), None)
        self.pool.give_back(back)
        super().vacate([w for w in gone if w not in back], kept)

    def release(self, extra: Sequence[WorkerRec]) -> None:
        # a spare's assign may still run: its reset must not overlap it (the worker is
        # threaded; the reset unloaded the job's modules under the assign's unpickling, a
        # KeyError in the suite). A spare still assigning after 30 s is killed, not kept.
        spares = [(w, r) for w, r in self._warming if actor_key(w.handle) in self._mine]
        ready, _ = wait_refs([r for _, r in spares], 30.0) if spares else ([], [])
        done = {id(r) for r in ready}
        back = [w for w in list(extra) + [w for w, r in spares if id(r) in done]
                if actor_key(w.handle) in self._mine]
        returned = {actor_key(w.handle) for w in back}
        lost = sorted(set(self._mine) - returned)
        self.pool.give_back(back, lost=lost)
        for a in lost:  # leave the books: killed (a no-op for one already dead) and its
            # bundle freed, whatever path lost track of it (one left alive held a CPU); a
            # bundle a replacement took over is no longer on its books (``_launch``)
            handle, pg = self._mine[a]
            WorkerPool._kill(_Proc(handle, pg, self._key()))
        self._mine = {}
        self._warming = [(w, r) for w, r in self._warming if w not in back]
        kept = {id(w.pg) for w in back}
        self.free_slots = [(pg, i) for pg, i in self.free_slots if id(pg) not in kept]
        super().release([w for w in extra if w not in back])
