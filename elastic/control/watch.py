"""Watching a running segment: its workers' futures, and their liveness connections.

A segment ends when every worker's future is done, or fails when one of them raised; with
liveness (``elastic.control.liveness``), a worker whose connection closed is known lost at
once, before any peer's collective fails and before Ray declares the actor dead, and a
worker that stays silent is lost once it also fails to answer a ping. The futures are looked
at every ``SLICE_S``, so a failure is seen within that, not at the controller's next poll.
How futures are waited for and read is the caller's (``WorkerGroup``: Ray), so this runs
without Ray in tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import WorkerLostError
from ..failures import Failure, classify
from .group import Segment, SegmentPoll, WorkerRec

__all__ = ["SegmentWatch", "SLICE_S", "GRACE_S", "Wait"]

SLICE_S = 0.05  # how often the futures and liveness are looked at
GRACE_S = 1.0  # after a failure, how long peers get to report a more specific cause

Wait = Callable[[list[Any], float], tuple[list[Any], list[Any]]]


class SegmentWatch:
    """``liveness``: an ``elastic.control.liveness.Liveness`` or None; ``ping(worker)``:
    whether a silent worker still answers (called at most once per ``timeout_s`` per
    worker)."""

    def __init__(self, liveness: Any, ping: Callable[[WorkerRec], bool]) -> None:
        self.liveness = liveness
        self._ping = ping
        self._cleared: dict[int, float] = {}  # worker id -> when a ping last answered

    def lost(self, workers: Sequence[WorkerRec]) -> list[WorkerRec]:
        """Of ``workers``: those whose liveness connection closed, and those silent for
        longer than its timeout that do not answer a ping either."""
        if self.liveness is None:
            return []
        ids = [w.worker_id for w in workers]
        gone = set(self.liveness.lost(ids))
        now = time.monotonic()
        for wid in self.liveness.suspect(ids, now):
            if now - self._cleared.get(wid, -1e9) < self.liveness.timeout_s:
                continue
            w = next(x for x in workers if x.worker_id == wid)
            if self._ping(w):
                self._cleared[wid] = now  # slow, not gone (a loaded machine)
            else:
                gone.add(wid)
        return [w for w in workers if w.worker_id in gone]

    def gather(self, refs: Sequence[Any], workers: Sequence[WorkerRec], timeout_s: float,
               wait: Wait) -> set[int]:
        """Wait up to ``timeout_s`` for ``refs`` (one call per worker of ``workers``), in
        slices, and stop waiting for a worker that liveness finds lost: its call would end
        only when Ray declares the actor dead (1.2 s after a node's loss with the tests'
        fast health checks, 15 s and more with Ray's defaults), and until then the
        controller would see nothing else. Returns the indices of the calls that ended."""
        end = time.monotonic() + timeout_s
        pending = dict(enumerate(refs))
        ended: set[int] = set()
        while pending:
            done, _ = wait(list(pending.values()), max(0.0, min(SLICE_S, end - time.monotonic())))
            ids = {id(r) for r in done}
            ended |= {i for i, r in pending.items() if id(r) in ids}
            pending = {i: r for i, r in pending.items() if i not in ended}
            if not pending or time.monotonic() >= end:
                break
            gone = {id(w) for w in self.lost([workers[i] for i in pending])}
            pending = {i: r for i, r in pending.items() if id(workers[i]) not in gone}
        return ended

    def lost_error(self, w: WorkerRec) -> WorkerLostError:
        """The error of a worker liveness found lost (its node, if it said so)."""
        node = bool(getattr(self.liveness, "node_lost", lambda _: False)(w.worker_id))
        why = ("its node's raylet is gone (the worker saw it and ended)" if node else
               "its liveness connection to the controller closed or fell silent")
        return WorkerLostError(f"worker rank {w.rank} lost: {why}", rank=w.rank, node_lost=node)

    def poll(self, seg: Segment, timeout_s: float, wait: Wait,
             failures: Callable[[Segment, list[Any]], list[Failure]],
             next_step: Callable[[list[Any]], int]) -> SegmentPoll:
        """Wait up to ``timeout_s`` for ``seg``: done (every future returned), failed (what
        the workers that ended raised, and the workers liveness found lost; after a first
        failure, peers get up to ``GRACE_S`` to report theirs), or still running."""
        futs = [f for _, f in seg.running]
        workers = [w for w, _ in seg.running]
        end = time.monotonic() + timeout_s
        grace: float | None = None
        got: list[Failure] = []
        pending = futs
        while True:
            left = (grace if grace is not None else end) - time.monotonic()
            done, pending = wait(futs, max(0.0, min(SLICE_S, left)))
            got = failures(seg, done)
            gone = self.lost(workers)
            if gone:
                return SegmentPoll(failures=tuple(
                    [classify(self.lost_error(w), rank=w.rank) for w in gone] + got),
                    noticed_by="liveness")
            if got and pending and grace is None:
                grace = time.monotonic() + GRACE_S
            if not pending or time.monotonic() >= (grace if grace is not None else end):
                break
        if got:
            by = "actor" if any(isinstance(f.error, WorkerLostError) for f in got) else (
                "collective")
            return SegmentPoll(failures=tuple(got), noticed_by=by)
        if pending:
            return SegmentPoll()
        return SegmentPoll(done=True, next_step=next_step(futs))
