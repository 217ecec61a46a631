"""Decisions as policies: pure ``decide(observation) -> decision`` classes.

The live controller (``elastic.control``) observes its job, asks a policy, and carries out
the decision; the simulator (``clusters.simulator``) asks the same classes about simulated
jobs. So what is simulated is what runs. Nothing here imports torch or Ray, reads a clock or
touches a cluster: an observation carries everything a decision depends on, and every policy
is tested over its whole decision table (tests/unit/test_policies.py).

Policies:

* ``FailureBudget``: recover from a failure, or give up (user code, the budget spent).
* ``InPlaceRecovery`` / ``RestartAllRecovery``: where the state comes from after a
  membership change (surviving peers, the newest checkpoint, or scratch), and whether every
  worker restarts.
* ``ScalingPolicy``: after a loss, which replacements to take or wait for and when to give
  up; while running, when to start spares and take them in; whether a requested size is
  allowed.
* ``RetentionPolicy``: which committed checkpoints to delete.
* ``NonFinitePolicy``: what a step whose loss or gradient is not finite does.
* ``ReplanPolicy`` (``clusters.replan_policy``): while a job runs, keep its layout, switch
  to a faster plan, or re-cut the shares around a straggler, when the predicted gain over the
  remaining steps pays for the re-layout; try a plan predicted too close to order.
* ``EvacuationPolicy``: what a job does about a node that will go away at a known time (a
  preemption notice or a maintenance drain): move its state onto the survivors now,
  checkpoint it and then recover, or let the node go and recover at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .evacuation import EVACUATION_PATHS, Evacuate, EvacuationObservation, EvacuationPolicy
from .replan_policy import (
    KeepPlan,
    LoopMemory,
    RecutShares,
    ReplanObservation,
    ReplanPolicy,
    SwitchPlan,
    TryPlan,
)

__all__ = [
    "FailureObservation",
    "Recover",
    "GiveUp",
    "FailureBudget",
    "RestoreObservation",
    "Restore",
    "InPlaceRecovery",
    "RestartAllRecovery",
    "ScalingObservation",
    "Acquire",
    "Proceed",
    "StartSpares",
    "Resize",
    "Refuse",
    "ScalingPolicy",
    "CheckpointRecord",
    "RetentionPolicy",
    "NonFiniteObservation",
    "SkipStep",
    "Rollback",
    "Stop",
    "NonFinitePolicy",
    "ReplanObservation",
    "KeepPlan",
    "SwitchPlan",
    "TryPlan",
    "LoopMemory",
    "RecutShares",
    "ReplanPolicy",
    "EvacuationObservation",
    "Evacuate",
    "EvacuationPolicy",
    "EVACUATION_PATHS",
]


# --------------------------------------------------------------------------- failures


@dataclass(frozen=True)
class FailureObservation:
    """A failure of a running job. ``kind`` is an ``elastic.failures.FailureKind`` value
    (``"node_lost"``, ``"user_code"``...); ``failures`` counts the job's failures so far,
    this one included. ``lost``: workers it took; ``repeats``: how many failures just before
    it, in a row, were this one (kind, message, ``step``), none of them taking a worker."""

    kind: str
    recoverable: bool
    failures: int
    message: str = ""
    lost: int = 0
    repeats: int = 0
    step: int | None = None


@dataclass(frozen=True)
class Recover:
    """Survive it: form a new group and restore the state."""

    reason: str


@dataclass(frozen=True)
class GiveUp:
    """End the job with this reason (the error the user sees says it and the fix)."""

    reason: str


@dataclass(frozen=True)
class FailureBudget:
    """Recover from infrastructure failures (lost workers, hangs, broken groups) up to
    ``max_failures`` times (-1: unlimited); give up at once on anything else (user code, a
    configuration, the cluster), since doing the same again would fail the same way. A
    failure that took no worker and comes back the same at the same step after a recovery
    is the job's or the layout's, not the cluster's (a collective refusing a strided tensor
    failed a pipeline four times, then said "fix the cluster"; with ``max_failures: -1`` it
    would never have ended): the second time ends the job."""

    max_failures: int = 3

    def decide(self, obs: FailureObservation) -> Recover | GiveUp:
        if not obs.recoverable:
            return GiveUp(f"{obs.kind.replace('_', ' ')} is not recoverable: {obs.message}")
        if obs.repeats >= 1 and obs.lost == 0:
            at = f" at step {obs.step}" if obs.step is not None else ""
            return GiveUp(f"the same failure came back{at} after a recovery, {obs.repeats + 1} "
                          f"times in a row, and no worker was lost: {obs.message}. It follows "
                          "the job, not the cluster. Fix: the layout or the job's code (run "
                          "`strategy: dp` to tell which; the workers' logs have the traceback)")
        if 0 <= self.max_failures < obs.failures:
            return GiveUp(f"giving up after {obs.failures} failures (max_failures="
                          f"{self.max_failures}): {obs.message}. Fix: raise max_failures (-1 for "
                          "unlimited) or fix the cluster.")
        return Recover(f"{obs.kind.replace('_', ' ')} ({obs.failures} of "
                       f"{'unlimited' if self.max_failures < 0 else self.max_failures})")


# --------------------------------------------------------------------------- restore source


@dataclass(frozen=True)
class RestoreObservation:
    """What can restore the state after a membership change.

    ``position``: the newest step any worker's state reached (the first step not in it).
    ``peer_step``: a step at which every entry of the state has a live holder (None: no
    such step; under dp every replica qualifies, under ZeRO a lost shard has none).
    ``checkpoints``: committed checkpoint steps believed valid, any order.
    ``cause``: ``"failure"`` (workers were lost) or ``"join"`` (workers were added).
    ``buddy_step``: a step at which the survivors' host memory holds every entry: each
    rank's own snapshot, and for each lost rank the copy its buddy keeps, every copy
    verified against its checksum (None: copies are off, stale, corrupt, or a rank and its
    buddy were lost together)."""

    position: int
    peer_step: int | None
    checkpoints: tuple[int, ...] = ()
    cause: str = "failure"
    buddy_step: int | None = None


@dataclass(frozen=True)
class Restore:
    """Take the state from ``source`` (``"peers"``, ``"buddies"``, ``"checkpoint"`` or
    ``"scratch"``) at ``step``; ``restart_all``: every worker restarts its process first."""

    source: str
    step: int
    restart_all: bool = False


def _newest(checkpoints: Sequence[int]) -> int | None:
    return max(checkpoints) if checkpoints else None


@dataclass(frozen=True)
class InPlaceRecovery:
    """elastic's: survivors keep their processes; the state comes from live peers when every
    entry has a holder (no step lost), else from the buddies' copies in the survivors' memory
    (no storage read; the steps since the copy are run again) unless a newer checkpoint
    loses fewer steps, else the newest checkpoint, else step 0."""

    name: str = "elastic"

    def decide(self, obs: RestoreObservation) -> Restore:
        if obs.peer_step is not None:
            return Restore("peers", obs.peer_step)
        ck = _newest(obs.checkpoints)
        if obs.buddy_step is not None and (ck is None or obs.buddy_step >= ck):
            return Restore("buddies", obs.buddy_step)
        if ck is not None:
            return Restore("checkpoint", ck)
        return Restore("scratch", 0)


@dataclass(frozen=True)
class RestartAllRecovery:
    """Ray Train's and torchrun's: any membership change restarts every worker from the
    newest checkpoint (step 0 without one). The simulator's baseline."""

    name: str = "restart-all"

    def decide(self, obs: RestoreObservation) -> Restore:
        ck = _newest(obs.checkpoints)
        if ck is not None:
            return Restore("checkpoint", ck, restart_all=True)
        return Restore("scratch", 0, restart_all=True)


# --------------------------------------------------------------------------- scaling


@dataclass(frozen=True)
class ScalingObservation:
    """The job's size and what could change it.

    ``phase``: ``"recovery"`` (just lost workers; nothing acquired yet), ``"recovered"``
    (after taking spares and placing replacements), ``"waited"`` (after the wait below
    ``min_workers``), or ``"running"`` (a periodic check while training).
    ``workers``: in the job now; ``target``: the size it wants; ``spares_ready``: workers
    started in the background that answer; ``spares_starting``: those still starting;
    ``room``: a free reserved slot or free resources for one more worker."""

    phase: str
    workers: int
    target: int
    min_workers: int
    max_workers: int
    spares_ready: int = 0
    spares_starting: int = 0
    room: bool = False


@dataclass(frozen=True)
class Acquire:
    """Take ``take`` ready spares, then place up to ``place`` new workers, waiting at most
    ``wait_s`` for them (0: do not wait)."""

    take: int
    place: int
    wait_s: float
    reason: str = ""


@dataclass(frozen=True)
class Proceed:
    """Go on with the workers there are."""

    reason: str = ""


@dataclass(frozen=True)
class StartSpares:
    """Start ``n`` workers in the background (they join at a step boundary once up)."""

    n: int


@dataclass(frozen=True)
class Resize:
    """At the next step boundary, change the group to ``n`` workers; ``warm_only``: only by
    spares already up (never wait for a placement)."""

    n: int
    warm_only: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Refuse:
    """A requested change is not allowed; the reason says why and what is."""

    reason: str


@dataclass(frozen=True)
class ScalingPolicy:
    """Sizes between ``min_workers`` and ``max_workers``.

    After a loss the job goes on with the survivors and every ready spare, up to its target
    (replacements start in the background and join later, unless ``replacement_timeout_s``
    asks to wait for them). Below ``min_workers`` it waits ``min_workers_timeout_s`` for
    placements, then gives up. While running, ready spares are taken in at a step boundary
    and room starts new spares, up to the target."""

    replacement_timeout_s: float = 0.0
    min_workers_timeout_s: float = 60.0

    def decide(self, obs: ScalingObservation) -> Acquire | Proceed | GiveUp | StartSpares | Resize:
        want = min(max(obs.target, obs.min_workers), obs.max_workers)
        short = want - obs.workers
        if obs.phase == "recovery":
            if short <= 0:
                return Proceed("the survivors make the target size")
            take = min(short, obs.spares_ready)
            place = short - take if self.replacement_timeout_s > 0 else 0
            return Acquire(take, place, self.replacement_timeout_s if place else 0.0,
                           "replacements for the lost workers")
        if obs.phase == "recovered":
            if obs.workers >= obs.min_workers:
                return Proceed(f"{obs.workers} workers")
            return Acquire(0, obs.min_workers - obs.workers, self.min_workers_timeout_s,
                           f"{obs.workers} workers < min_workers={obs.min_workers}")
        if obs.phase == "waited":
            if obs.workers >= obs.min_workers:
                return Proceed(f"{obs.workers} workers")
            return GiveUp(
                f"only {obs.workers} workers are left, fewer than min_workers={obs.min_workers}"
                f", and no replacement came within {self.min_workers_timeout_s:.0f}s. Fix: add "
                "nodes or lower min_workers.")
        if obs.phase == "running":
            if short > 0 and obs.spares_ready > 0:
                return Resize(obs.workers + min(short, obs.spares_ready), warm_only=True,
                              reason="a node with room joined")
            if short - obs.spares_starting > 0 and obs.room:
                return StartSpares(short - obs.spares_starting)
            return Proceed()
        raise ValueError(f"unknown scaling phase {obs.phase!r}")

    @staticmethod
    def check_request(n: int, min_workers: int, max_workers: int) -> Resize | Refuse:
        """A request to run on ``n`` workers (already an int)."""
        if not min_workers <= n <= max_workers:
            return Refuse(f"cannot scale to {n} workers: outside min_workers..max_workers = "
                          f"{min_workers}..{max_workers}")
        return Resize(n, reason="requested")


# --------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint: its step, whether its state is finite (every loss and norm up
    to it was) and whether it verified (manifest and shard indices sound)."""

    step: int
    finite: bool = True
    verified: bool = True


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` checkpoints and every multiple of ``keep_every``, and
    never the deletion of the newest checkpoint that is finite and verified: a run whose
    last checkpoints went bad keeps its last good one however many came after it."""

    keep_last: int = 3
    keep_every: int = 0

    def decide(self, records: Sequence[CheckpointRecord]) -> tuple[int, ...]:
        """The steps to delete, oldest first."""
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        steps = sorted(r.step for r in records)
        keep = set(steps[-self.keep_last:])
        if self.keep_every > 0:
            keep.update(s for s in steps if s % self.keep_every == 0)
        good = [r.step for r in records if r.finite and r.verified]
        if good:
            keep.add(max(good))
        return tuple(s for s in steps if s not in keep)


# --------------------------------------------------------------------------- non-finite steps


@dataclass(frozen=True)
class NonFiniteObservation:
    """A step whose loss or gradient norm was NaN or inf on some rank. ``consecutive``:
    non-finite steps in a row, this one included."""

    step: int
    consecutive: int
    rank: int | None = None


@dataclass(frozen=True)
class SkipStep:
    """Drop the step's update on every rank (the state stays at the step before)."""

    reason: str


@dataclass(frozen=True)
class Rollback:
    """Go back to the newest finite state (peers' or a checkpoint's) and go on from there."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """End the job with an error naming the step and the rank."""

    reason: str


ON_NONFINITE = ("skip", "rollback", "stop")


@dataclass(frozen=True)
class NonFinitePolicy:
    """``skip``: drop the update, and stop once ``max_skips`` steps in a row were skipped (a
    model that diverged does not come back by skipping); ``rollback``: restore the newest
    finite state; ``stop``: end the job at once."""

    mode: str = "skip"
    max_skips: int = 5

    def decide(self, obs: NonFiniteObservation) -> SkipStep | Rollback | Stop:
        where = f"step {obs.step}" + (f" (rank {obs.rank})" if obs.rank is not None else "")
        if self.mode == "stop":
            return Stop(f"non-finite loss or gradient at {where}")
        if self.mode == "rollback":
            return Rollback(f"non-finite loss or gradient at {where}")
        if self.mode != "skip":
            raise ValueError(f"unknown on_nonfinite mode {self.mode!r}; use {ON_NONFINITE}")
        if obs.consecutive > self.max_skips:
            return Stop(f"{obs.consecutive} non-finite steps in a row up to {where} (more than "
                        f"max_nonfinite_skips={self.max_skips}): the run diverged")
        return SkipStep(f"non-finite loss or gradient at {where}: update skipped "
                        f"({obs.consecutive} in a row)")
