"""The simulated systems: the live policies (``clusters.policy``) plus what each step costs.

A ``SimPolicy`` is a composition. Its decisions come from the same classes the live
controller executes: ``FailureBudget`` (recover or give up), ``ScalingPolicy`` (go on with
the survivors or wait for a replacement), and ``InPlaceRecovery`` / ``RestartAllRecovery``
(where the state comes from, whether every worker restarts, and so whether a join costs a
rollback). What only a simulation needs is the separate ``TimeCosts`` table: how long
detection, a restart or re-plan, and a grow take; restore times come from the state's size
(``RestoreTimes``).

Two systems, kept under their old names:

* ``RestartAll()``: Ray Train and torchrun as large jobs run them, at a fixed size
  (``ScalingConfig(num_workers=N)``, ``torchrun --nnodes=N``): after a failure the group
  waits until it is whole again (a spare or the repaired node) and every worker restarts from
  the newest checkpoint. One rollback per failure; a repaired node coming back later is not a
  membership change. ``RestartAll(shrink=True)`` is their elastic mode
  (``num_workers=(min, max)``, ``--nnodes=MIN:MAX``): restart on the survivors, and restart
  again when the node returns, each time from the newest checkpoint (Ray Train executes a
  resize exactly like a failure recovery; torchrun restarts every worker on a membership
  change), so both roll back.
* ``ElasticInPlace()``: this project: survivors keep their processes, the state comes from
  live peers when every entry has one (else the newest checkpoint), the job goes on with the
  survivors, and a returning node joins at a step boundary losing nothing.
  ``peer_copy_every=k``: each rank also keeps a copy of its shard in a buddy's host memory,
  refreshed every k steps, so a loss under a sharded layout restores from peers losing at
  most k steps (``InPlaceRecovery``'s ``buddy_step``; a second loss before the next copy
  after a change finds none and reads the checkpoint). ``evacuation=EvacuationPolicy()``: at
  the step boundary after a preemption notice, the live controller's policy decides from the
  time left: ``move`` the state only the draining node holds onto the survivors (no step
  lost; a pause of the hand-over plus one live switch), ``checkpoint`` then recover (no
  step lost), or ``recover`` (release the node now, recover as from a loss).

Preemption notices (``on_notice``) are ignored unless the system has an ``evacuation`` policy
or ``checkpoint_on_notice`` (Ray Train V2: checkpoint on the notice, then restart the group:
``RestartAll(checkpoint_on_notice=True)``); an ignored notice leaves the loss at the deadline,
as an unannounced one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import SimulationError
from .policy import (
    Acquire,
    Evacuate,
    EvacuationObservation,
    EvacuationPolicy,
    FailureBudget,
    FailureObservation,
    GiveUp,
    InPlaceRecovery,
    Resize,
    RestartAllRecovery,
    Restore,
    RestoreObservation,
    ScalingObservation,
    ScalingPolicy,
)

__all__ = [
    "TimeCosts",
    "RestoreTimes",
    "JobView",
    "Recovery",
    "SimPolicy",
    "RestartAll",
    "ElasticInPlace",
]


@dataclass(frozen=True, kw_only=True)
class TimeCosts:
    """Seconds a simulated system spends on each part of a membership change.

    ``detection_s``: a lost node or process is seen; ``hang_detection_s``: a hung collective
    is seen (the group timeout); ``restart_s``: every worker process restarted and the group
    formed again (a ``restart_all`` decision); ``replan_s``: survivors re-plan and form a new
    group in place; ``grow_s``: a join taken in place at a step boundary (and the fixed part
    of an evacuation's pause, a live switch, to which the move of the node's state adds).
    """

    detection_s: float = 1.0
    hang_detection_s: float = 60.0
    restart_s: float = 120.0
    replan_s: float = 10.0
    grow_s: float = 10.0

    def detection(self, kind: str) -> float:
        return self.hang_detection_s if kind == "hang" else self.detection_s


@dataclass(frozen=True)
class RestoreTimes:
    """Seconds to restore the whole state from ``storage`` (a checkpoint) or from live peers."""

    storage_s: float
    peers_s: float

    def of(self, source: str) -> float:
        """Restore time from ``source`` (``"checkpoint"``; ``"peers"`` or ``"buddies"``: the
        survivors' memory, one node's share over its network; ``"scratch"``: none)."""
        return {"checkpoint": self.storage_s, "peers": self.peers_s,
                "buddies": self.peers_s}.get(source, 0.0)


@dataclass(frozen=True)
class JobView:
    """What a policy sees of the simulated job at a membership change.

    ``position``: the last step every worker completed; ``checkpoints``: committed checkpoint
    steps; ``workers``: devices in the job after a loss (before a join); ``target``: devices of
    the whole cluster; ``failures``: the job's failures so far, this one included;
    ``last_change``: the step of the last membership change (peer copies made before it
    paired ranks that may be gone)."""

    position: int
    checkpoints: tuple[int, ...]
    workers: int
    target: int
    failures: int = 0
    last_change: int = 0


@dataclass(frozen=True)
class Recovery:
    """What a membership change costs: stop ``downtime_s``, and ``rollback`` (the state goes
    back to ``restore.step``, a checkpoint or step 0) or not. ``waited_s``: the part of the
    downtime spent waiting for a replacement."""

    downtime_s: float
    rollback: bool
    restore: Restore | None = None
    waited_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SimPolicy:
    """A simulated system: the live policies it runs, and its ``TimeCosts``.

    ``fixed_size``: the job runs only on the whole cluster (min_workers = max_workers = all
    devices); otherwise it goes on with as few as one device. ``peer_copy_every``: steps
    between refreshes of each rank's shard copy in a buddy's host memory (0: no copies).
    ``evacuation``: what a preemption notice does (None: nothing, unless
    ``checkpoint_on_notice``: checkpoint, then recover).
    """

    name: str
    recovery: InPlaceRecovery | RestartAllRecovery
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    budget: FailureBudget = field(default_factory=lambda: FailureBudget(max_failures=-1))
    fixed_size: bool = False
    costs: TimeCosts = field(default_factory=TimeCosts)
    peer_copy_every: int = 0
    evacuation: EvacuationPolicy | None = None
    checkpoint_on_notice: bool = False

    def _min_workers(self, job: JobView) -> int:
        return job.target if self.fixed_size else 1

    def buddy_step(self, job: JobView) -> int | None:
        """The step of the newest complete generation of buddy copies (``peer_copy_every``
        k: the last multiple of k reached, or the first step after the last membership
        change, which takes one as the live ``PeerCopies`` does), if it was made after that
        change (a change re-pairs the ranks; the copies of the old ring are not counted);
        None without copies."""
        k = self.peer_copy_every
        if k <= 0:
            return None
        copy = job.position // k * k
        if job.last_change == 0:  # since the start: the live job's first copy is after k
            return copy if copy > 0 else None  # steps (none at step 0)
        if copy > job.last_change:
            return copy
        first = job.last_change + 1
        return first if job.position >= first else None

    def on_failure(
        self, kind: str, job: JobView, replicas_survive: bool, replacement_in_s: float,
        restore: RestoreTimes,
    ) -> Recovery | GiveUp:
        """The job lost a node (or a process, or hung, per ``kind``) without notice; every
        missing node is back ``replacement_in_s`` from now. Asks the failure budget, the
        scaling policy (wait for the replacement or not) and the recovery policy (where the
        state comes from: live replicas when ``replicas_survive``, the buddies' copies, a
        checkpoint)."""
        return self._recover(kind, job, self.costs.detection(kind), replicas_survive,
                             job.checkpoints, replacement_in_s, restore)

    def _recover(
        self, kind: str, job: JobView, stopped_s: float, replicas_survive: bool,
        checkpoints: tuple[int, ...], replacement_in_s: float, restore: RestoreTimes,
    ) -> Recovery | GiveUp:
        """The budget, the wait, the restore source; ``stopped_s`` before the wait starts
        (detection, or an evacuation's checkpoint)."""
        verdict = self.budget.decide(FailureObservation(kind, True, job.failures, kind))
        if isinstance(verdict, GiveUp):
            return verdict
        waited = self._wait(job, max(0.0, replacement_in_s - stopped_s))
        if isinstance(waited, GiveUp):
            return waited
        peer = job.position if replicas_survive else None
        buddy = None if replicas_survive else self.buddy_step(job)
        r = self.recovery.decide(RestoreObservation(job.position, peer, checkpoints,
                                                    buddy_step=buddy))
        again = self.costs.restart_s if r.restart_all else self.costs.replan_s
        return Recovery(stopped_s + waited + again + restore.of(r.source),
                        r.source in ("checkpoint", "scratch"), r, waited)

    def on_notice(
        self, job: JobView, deadline_s: float, move_s: float, checkpoint_s: float,
        survivors: int, fits: bool,
    ) -> Evacuate | None:
        """At the step boundary after a preemption notice, ``deadline_s`` before the node
        goes: what the system does (``policy.Evacuate``: ``move``, ``checkpoint`` or
        ``recover``), or None (the notice is ignored and the node is lost at its deadline).
        ``move_s``: seconds the node is needed to hand over the state only it holds;
        ``checkpoint_s``: seconds to write a checkpoint; ``survivors``: devices left;
        ``fits``: a plan for the survivors fits their memory. No wait for replacements is
        offered (``replace_wait_s`` 0): a simulated cluster has no spare node to place one
        on before the node goes (a node comes back only once repaired)."""
        if self.evacuation is not None:
            return self.evacuation.decide(EvacuationObservation(
                deadline_s, move_s, checkpoint_s, survivors, self._min_workers(job), fits,
                self.buddy_step(job) is not None))
        if self.checkpoint_on_notice:
            return Evacuate("checkpoint", "Ray Train V2: checkpoint on the notice, then "
                            "restart the group from it")
        return None

    def move_pause_s(self, move_s: float) -> float:
        """An evacuation's pause (``move``): the hand-over (``move_s``) plus a live switch
        onto the survivors (``grow_s``: re-plan, re-form, reshard)."""
        return move_s + self.costs.grow_s

    def on_release(
        self, path: str, job: JobView, checkpoint_s: float, replicas_survive: bool,
        replacement_in_s: float, restore: RestoreTimes,
    ) -> Recovery | GiveUp:
        """The draining node was released at the step boundary ``job.position`` (its loss
        needs no detection), after a checkpoint of the whole state (``path`` ``checkpoint``:
        ``checkpoint_s`` spent, committed at this step) or at once (``recover``); the job
        recovers as after a loss."""
        if path == "checkpoint":
            return self._recover("preempted", job, checkpoint_s, replicas_survive,
                                 job.checkpoints + (job.position,), replacement_in_s, restore)
        return self._recover("preempted", job, 0.0, replicas_survive, job.checkpoints,
                             replacement_in_s, restore)

    def _wait(self, job: JobView, back_in: float) -> float | GiveUp:
        """Seconds the job waits for the missing nodes, as ``ScalingPolicy`` decides: after a
        loss (``recovery``), then below min_workers (``recovered``, ``waited``)."""
        lo = self._min_workers(job)
        waited = 0.0
        for phase in ("recovery", "recovered"):
            d = self.scaling.decide(
                ScalingObservation(phase, job.workers, job.target, lo, job.target))
            if not (isinstance(d, Acquire) and d.place > 0):
                continue
            if back_in <= waited + d.wait_s:
                return back_in
            waited += d.wait_s
        last = self.scaling.decide(
            ScalingObservation("waited", job.workers, job.target, lo, job.target))
        return last if isinstance(last, GiveUp) else waited

    def on_join(self, job: JobView, joining: int, restore: RestoreTimes) -> Recovery | None:
        """``joining`` devices came back while the job runs on ``job.workers``. None: the
        scaling policy leaves them out; else what taking them costs (a ``restart_all``
        recovery restores the newest checkpoint: a rollback)."""
        d = self.scaling.decide(ScalingObservation(
            "running", job.workers, job.target, self._min_workers(job), job.target,
            spares_ready=joining))
        if not isinstance(d, Resize):
            return None
        r = self.recovery.decide(
            RestoreObservation(job.position, job.position, job.checkpoints, cause="join"))
        if r.restart_all:
            return Recovery(self.costs.restart_s + restore.of(r.source), r.source != "peers", r)
        if r.source == "peers":  # the joiner's share of the state is part of the grow
            return Recovery(self.costs.grow_s, False, r)
        return Recovery(self.costs.grow_s + restore.of(r.source), True, r)


# RestartAll and ElasticInPlace were classes; they stay callable under those names.
def RestartAll(
    *,
    name: str = "restart-all",
    detection_s: float = 15.0,
    restart_s: float = 120.0,
    hang_detection_s: float = 600.0,
    shrink: bool = False,
    max_failures: int = -1,
    checkpoint_on_notice: bool = False,
) -> SimPolicy:
    """Ray Train / torchrun: any membership change restarts every worker from the newest
    checkpoint (``RestartAllRecovery``). Fixed size by default (wait for the whole cluster);
    ``shrink=True``: their elastic mode (go on with the survivors, restart again on a join).

    Detection ~15 s: a dead node shows in ``ray.nodes()`` after 13.6-14.9 s by default
    (shared/notes/measured-here.md); a hang only at the NCCL timeout (torch's default 10 min).
    Restart: group re-creation and start-up (Ray Train ~9-15 s on a toy job; minutes at scale).
    ``checkpoint_on_notice``: Ray Train V2's preemption handling (checkpoint when a node is
    draining, then restart the group from it); otherwise notices are ignored (torchrun).
    """
    return SimPolicy(
        name=name,
        recovery=RestartAllRecovery(),
        scaling=ScalingPolicy(replacement_timeout_s=0.0 if shrink else math.inf),
        budget=FailureBudget(max_failures=max_failures),
        fixed_size=not shrink,
        costs=TimeCosts(detection_s=detection_s, hang_detection_s=hang_detection_s,
                        restart_s=restart_s, replan_s=restart_s, grow_s=restart_s),
        checkpoint_on_notice=checkpoint_on_notice,
    )


def ElasticInPlace(
    *,
    name: str = "elastic",
    detection_s: float = 1.0,
    replan_s: float = 10.0,
    grow_s: float = 10.0,
    hang_detection_s: float = 60.0,
    max_failures: int = -1,
    peer_copy_every: int = 0,
    evacuation: EvacuationPolicy | None = None,
) -> SimPolicy:
    """This project (``InPlaceRecovery``, ``ScalingPolicy`` without a replacement wait):
    survivors keep their state; detection ~1 s (survivors blocked in a collective error out
    0.2-1 s after a node dies), a hang at ``hang_timeout_s`` (60 s by default).
    ``peer_copy_every``, ``evacuation``: see the module docstring. Raises
    ``SimulationError`` for a ``peer_copy_every`` that is not an integer >= 0."""
    if isinstance(peer_copy_every, bool) or not isinstance(peer_copy_every, int) or (
            peer_copy_every < 0):
        raise SimulationError(f"peer_copy_every must be an integer >= 0 (steps; 0: no copies)"
                              f", got {peer_copy_every!r}")
    return SimPolicy(
        name=name,
        recovery=InPlaceRecovery(),
        scaling=ScalingPolicy(replacement_timeout_s=0.0),
        budget=FailureBudget(max_failures=max_failures),
        costs=TimeCosts(detection_s=detection_s, hang_detection_s=hang_detection_s,
                        restart_s=replan_s, replan_s=replan_s, grow_s=grow_s),
        peer_copy_every=peer_copy_every,
        evacuation=evacuation,
    )
