"""The job's size: the target it wants, growth that waits for room, and the scaling
policy's periodic check while it trains.

A requested growth never pauses training for a placement: spares start in the background,
a step boundary takes them in once they are up (a warm-only resize), and the request is
answered then, or refused after ``SCALE_WAIT_S`` with the size the job could reach (the
target then goes back to it). A shrink happens at the next boundary.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from clusters.policy import Proceed, Resize, ScalingObservation, ScalingPolicy, StartSpares

from ..errors import SwitchError
from .requests import Inbox, Request
from .states import Resizing, State

__all__ = ["Sizing", "SCALE_WAIT_S"]

SCALE_WAIT_S = 30.0  # a requested growth that no room meets is refused after this


class Sizing:
    """Owns the job's target size: ``max_workers`` (``num_workers`` for a job that grows only
    when asked, ``grow_when_room`` false), then what a scale asked for."""

    def __init__(self, cfg: Any, inbox: Inbox) -> None:
        self.cfg = cfg
        self.inbox = inbox
        self.target = (cfg.max_workers if cfg.max_workers is not None and cfg.grow_when_room
                       else cfg.num_workers)
        self._before: tuple[Request, int] | None = None  # a scale in hand, the target before it

    def after_loss(self, had: int) -> int:
        """The size a recovery places replacements up to: back to ``num_workers`` (or the
        ``had`` workers it had, if more), but never past the target a scale request set (a
        job the scheduler shrank does not take back workers it gave to another job)."""
        return min(max(self.cfg.num_workers, had), max(self.target, self.cfg.min_world))

    def check(self, group: Any) -> Request | None:
        """The scaling policy's running check: a ``grow`` request when spares are up and the
        job is below its target (taken in at the next boundary); spares started where there
        is room."""
        d = ScalingPolicy().decide(ScalingObservation(
            "running", len(group.workers), self.target, self.cfg.min_world, self.cfg.max_world,
            spares_ready=group.spares_ready(), spares_starting=group.spares_starting(),
            room=len(group.workers) + group.spares_starting() < self.target and group.room()))
        # reserved slots beyond what the job may still grow into are given back
        group.trim_slots(max(0, self.target - len(group.workers) - group.spares_starting()))
        if isinstance(d, Resize):  # (for a scale asked for and parked: that scale's reason)
            why = next((r.reason for r, _ in self.inbox.parked if r.kind == "scale"), d.reason)
            return None if self.inbox.has("grow") else Request("grow", reason=why)
        if isinstance(d, StartSpares):
            group.start_spares(d.n)
        else:
            assert isinstance(d, Proceed)
        return None

    def ask(self, req: Request, group: Any, answer: Any) -> State | None:
        """A ``scale`` request at a boundary: a resize to carry out, or None (answered, or
        parked until spares are up)."""
        check = ScalingPolicy.check_request(int(req.value), self.cfg.min_world,
                                            self.cfg.max_world)
        if not isinstance(check, Resize):
            answer(req, SwitchError(check.reason))
            return None
        n, have = check.n, len(group.workers)
        self._before = (req, self.target)
        self.target = n
        if n < have:
            return Resizing(n, req.reason, request=req)
        if n == have:
            answer(req, have)
            return None
        self.inbox.park(req, time.monotonic() + SCALE_WAIT_S)
        group.start_spares(n - have - group.spares_starting())
        if group.spares_ready():
            return Resizing(n, req.reason, warm_only=True)
        return None

    @contextlib.contextmanager
    def carrying(self, req: Request | None) -> Iterator[None]:
        """Around the resize that carries out ``req``: if it raises (its asker is told so),
        the target goes back to what it was before ``req``, so that the recovery that
        follows neither shrinks the job to, nor later grows it to, a size its asker was
        told it did not get."""
        try:
            yield
        except BaseException:
            if req is not None and self._before is not None and self._before[0] is req:
                self.target = self._before[1]
            raise
        finally:
            self._before = None

    def settle(self, workers: int, status: Callable[[], dict[str, Any]] = dict) -> None:
        """Answer parked growth the job reached; refuse what waited too long (the target
        goes back to the size the job has). ``status``: the job's, sent with the answers
        (as with every other request's)."""
        def refuse(want: int) -> Exception:
            return SwitchError(f"cannot scale to {want} workers: the cluster had room for "
                               f"{workers} within {SCALE_WAIT_S:.0f}s; the job goes on with "
                               f"{workers}. Fix: add nodes or free resources, then ask again")
        if self.inbox.settle_parked(workers, time.monotonic(), refuse, status):
            self.target = workers
