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
from dataclasses import dataclass
from typing import Any

from ..errors import GroupError, HangError, WorkerLostError
from ..failures import Failure, classify, first_cause
from .group import Segment, SegmentPoll, WorkerRec
from .steps import HANG_SLACK_S

__all__ = ["SegmentWatch", "SLICE_S", "GRACE_S", "STRAGGLE", "Wait", "Gathered", "hung_after",
           "stuck_signal"]

SLICE_S = 0.05  # how often the futures and liveness are looked at
GRACE_S = 1.0  # after a failure, how long peers get to report a more specific cause
STRAGGLE = 10.0  # an even call's ranks get this many times the first one's time (at least
# the hang window) after it answered


def hung_after(start: float, first_ok: float | None, first_failed: float | None,
               hang_s: float, even: bool) -> float | None:
    """When ranks still inside a worker call are hung (None: not yet known). After a rank's
    call failed: ``hang_s`` later (the group timeout and some slack: a healthy rank blocked
    on a hung peer in a collective has raised by then). For an ``even`` call (local work of
    about the same size on every rank): also ``STRAGGLE`` times the first answer's time
    after it, and at least ``hang_s``. Calls whose ranks do unequal work (peer copies,
    profiles, rank 0's full state) are not cut after a success: only a failure says a
    rank should have ended."""
    due = []
    if first_failed is not None:
        due.append(first_failed + hang_s)
    if even and first_ok is not None:
        due.append(first_ok + max(hang_s, STRAGGLE * (first_ok - start)))
    return min(due) if due else None


def stuck_signal(err: BaseException | None) -> bool:
    """Whether a rank's error says a peer may be stuck: its collective failed or timed out,
    a peer was lost or hung, or it only echoes another rank's failure."""
    return err is not None and (isinstance(err, GroupError | WorkerLostError | HangError)
                                or bool(getattr(err, "secondary", False)))


@dataclass(frozen=True)
class Gathered:
    """What ``SegmentWatch.collect`` saw: the indices of the calls that ended, and of those
    it stopped waiting for as hung (``why``: after what)."""

    ended: frozenset[int]
    hung: frozenset[int] = frozenset()
    why: str = ""

    def cause(self, errors: Sequence[BaseException]) -> BaseException:
        """The error to raise of the calls' ``errors`` (rank order): with hung ranks, a
        rank's own error first (a corrupt checkpoint: the caller acts on it), then the hang;
        else ``first_cause``."""
        if not self.hung:
            return first_cause(errors)
        own = [e for e in errors if not isinstance(e, GroupError | HangError)
               and not getattr(e, "secondary", False)]
        return (own or [e for e in errors if isinstance(e, HangError)] or list(errors))[0]

    def hang_error(self, w: WorkerRec, what: str, hang_s: float) -> HangError:
        """The error of ``w``, hung in its call ``what`` (ended by the caller)."""
        return HangError(f"worker rank {w.rank} was still inside its {what or 'call'} "
                         f"{hang_s:.0f}s after {self.why} (failures.hang_timeout_s + "
                         f"{HANG_SLACK_S:.0f}s): treated as hung, its process ended")

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
        return set(self.collect(refs, workers, timeout_s, wait).ended)

    def collect(self, refs: Sequence[Any], workers: Sequence[WorkerRec], timeout_s: float,
                wait: Wait, error_of: Callable[[Any], BaseException | None] | None = None,
                hang_s: float | None = None, even: bool = False) -> Gathered:
        """``gather``, and with ``error_of`` (an ended call's error, or None) and ``hang_s``:
        stop waiting, as hung, for the calls still running at ``hung_after``, counted from
        the first error that says a peer may be stuck (``stuck_signal``: a collective that
        failed or timed out; not a rank's own error, a corrupt checkpoint say, which says
        nothing of the others). Errors are looked at only while some call still runs."""
        start = time.monotonic()
        end = start + timeout_s
        pending = dict(enumerate(refs))
        ended: set[int] = set()
        first_ok: float | None = None
        first_failed: float | None = None
        failed_rank = -1
        while pending:
            done, _ = wait(list(pending.values()), max(0.0, min(SLICE_S, end - time.monotonic())))
            ids = {id(r) for r in done}
            now_ended = {i for i, r in pending.items() if id(r) in ids}
            ended |= now_ended
            if error_of is not None and hang_s is not None and len(ended) < len(refs):
                now = time.monotonic()
                for i in sorted(now_ended):
                    if first_failed is None and stuck_signal(error_of(pending[i])):
                        first_failed, failed_rank = now, workers[i].rank
                    elif first_ok is None:
                        first_ok = now
            pending = {i: r for i, r in pending.items() if i not in ended}
            if not pending or time.monotonic() >= end:
                break
            gone = {id(w) for w in self.lost([workers[i] for i in pending])}
            pending = {i: r for i, r in pending.items() if id(workers[i]) not in gone}
            if hang_s is None:
                continue
            due = hung_after(start, first_ok, first_failed, hang_s, even)
            if pending and due is not None and time.monotonic() >= due:
                why = (f"rank {failed_rank}'s call failed" if first_failed is not None
                       and first_failed + hang_s <= due + 1e-9 else
                       "the first rank answered")
                return Gathered(frozenset(ended), frozenset(pending), why)
        return Gathered(frozenset(ended))

    def wind_down(self, seg: Segment, timeout_s: float, wait: Wait,
                  leave: Callable[[WorkerRec], Any]) -> list[WorkerRec]:
        """After a failure: tell every rank whose segment has ended to leave its group at once
        (``leave``; its sockets close, so peers blocked on it fail now, not at the group
        timeout), keep doing so as the others end; return the ranks still in their segment
        after ``timeout_s`` (hung). A rank liveness finds lost is not waited for."""
        deadline = time.monotonic() + timeout_s
        pending = list(seg.running)
        while pending:
            finished, _ = wait([f for _, f in pending], 0.0)
            done = {id(f) for f in finished}
            gone = {id(w) for w in self.lost([w for w, _ in pending])}
            for w, f in pending:
                if id(f) in done and id(w) not in gone:
                    leave(w)
            pending = [(w, f) for w, f in pending if id(f) not in done and id(w) not in gone]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            wait([f for _, f in pending], min(left, SLICE_S))
        return [w for w, _ in pending]

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
