"""The planner: enumerate plans for a cluster, predict each, reject what does not fit, rank.

Candidates: for each device subset (all devices, then the fastest pools alone, the fastest
two, ... so that "drop the slow pool" is considered), the four dp/ZeRO strategies (with
gradient accumulation when activations need it; ``candidates``) and pipelines with pp in the
divisors of the subset size (2 <= pp <= blocks), each schedule, each dp_mode for hybrids,
keeping the best micro-batch count and device arrangement per (pp, dp_mode, schedule;
``pipeline_plans``). Batch shares follow device speed (``balance.proportional_shares``), stage
splits follow per-block cost and stage speed (``balance.stage_split``). Ranking is here, the
text in ``explain``. Pure and deterministic: the same input gives the same table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .candidates import Candidate, PlanContext, data_parallel_candidate, device_subsets
from .cost import CostModel
from .errors import PlanError
from .explain import explain
from .pipeline_plans import pipeline_candidates
from .plan import DP_MODES, SCHEDULES, STRATEGIES, Plan, keeps_state, more_work, trial_ran
from .profile import ModelProfile
from .topology import Cluster

__all__ = ["Candidate", "PlanResult", "break_tie", "plan"]


@dataclass(frozen=True)
class PlanResult:
    """Ranked fitting candidates (best first), rejected ones, the choice and why."""

    choice: Candidate | None
    ranked: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    explanation: str
    global_batch: int
    cluster_name: str
    emulated: bool

    @property
    def plan(self) -> Plan:
        """The chosen plan; raises ``PlanError`` listing the rejections if nothing fits."""
        if self.choice is None:
            raise PlanError(self.explanation)
        return self.choice.plan


def plan(
    cluster: Cluster,
    profile: ModelProfile,
    global_batch: int,
    *,
    optimizer: str | None = None,
    model: CostModel | None = None,
    speeds: Mapping[str, float] | None = None,
    strategies: Sequence[str] = STRATEGIES,
    schedules: Sequence[str] = SCHEDULES,
    dp_modes: Sequence[str] = DP_MODES,
    max_micro_batches: int = 64,
    max_pp: int | None = None,
    subsets: bool = True,
    tie_tolerance: float = 0.01,
    comfortable: float = 0.5,
    trial_tolerance: float = 0.05,
    rank_order: bool = False,
) -> PlanResult:
    """Choose a plan for training ``profile`` with global batch ``global_batch`` on ``cluster``.

    ``optimizer`` (adam, adamw, sgd, sgd_momentum) overrides the profile's optimizer bytes.
    ``speeds``: measured samples/s per device id (the live system's numbers); they replace the
    model's compute estimate for those devices. ``subsets=False`` uses every device.
    Ranking is by predicted step time; among plans within ``tie_tolerance`` of the fastest
    (the model is not that precise) one whose strategy the profiler's trial steps ran
    (``model.trial_layouts``) is chosen if its memory is comfortable (at most
    ``comfortable`` of usable), else the one with the most memory headroom, never one that
    does more work than another near plan with comfortable memory (``break_tie``: zero2
    beside zero1 with memory to spare). A plan a trial ran with comfortable memory is also
    chosen over faster ones predicted within ``trial_tolerance`` that no trial ran, and of
    those, one that keeps every rank's state on a peer (dp) first.
    ``rank_order``: each device's place in ``cluster.devices`` is its rank, which the plan
    keeps (the live workers: a spec cannot reorder them): a pipeline's stages go to the
    devices in that order, stage-major, the split following their speeds; without it the
    planner also arranges the stages by speed and the replicas by node, which a live spec
    would have applied to the workers in their own order (the slow one given the fast
    stage's blocks).
    Never raises for "nothing fits": ``choice`` is then ``None`` and ``explanation`` says why.
    """
    if global_batch < 1:
        raise PlanError(f"global batch must be >= 1, got {global_batch}")
    if optimizer is not None:
        profile = profile.with_optimizer(optimizer)
    model = model or CostModel()
    if speeds:
        sps = dict(model.seconds_per_sample)
        sps.update({k: 1.0 / v for k, v in speeds.items() if v > 0})
        model = replace(model, seconds_per_sample=sps)
    ctx = PlanContext(cluster, profile, global_batch, model, max_micro_batches)
    cands: list[Candidate] = []
    for label, devs in device_subsets(ctx) if subsets else [("all devices",
                                                              list(cluster.devices))]:
        for s in strategies:
            if s != "pipeline":
                cands.append(data_parallel_candidate(ctx, s, devs, label))
        if "pipeline" in strategies:
            cands.extend(pipeline_candidates(ctx, devs, label, schedules, dp_modes, max_pp,
                                             rank_order))
    fitting = [replace(c, peak_fraction=_peak_fraction(c)) for c in cands if c.fits]
    ranked = sorted(fitting, key=lambda c: (c.step_time, c.peak_fraction))
    rejected = tuple(c for c in cands if not c.fits)
    if ranked:
        best = break_tie(ranked, tie_tolerance, comfortable, model.trial_layouts,
                         trial_tolerance)
        ranked.remove(best)
        ranked.insert(0, best)
    choice = ranked[0] if ranked else None
    text = explain(choice, ranked, rejected, cluster, global_batch, model.trial_layouts,
                   trial_tolerance)
    if choice is not None:
        choice = replace(choice, plan=replace(choice.plan, reason=text.splitlines()[0]))
        ranked[0] = choice
    emulated = any(d.emulated for d in cluster.devices)
    return PlanResult(choice, tuple(ranked), rejected, text, global_batch, cluster.name, emulated)


def break_tie(ranked: Sequence[Candidate], tie_tolerance: float,
              comfortable: float, seen: Sequence[tuple[str, Sequence[str]]] = (),
              trial_tolerance: float = 0.0) -> Candidate:
    """The choice among fitting candidates sorted by predicted step time. Of those within
    ``tie_tolerance`` of the fastest (the model is not that precise), a candidate that does
    more work than another near one whose memory is comfortable (at most ``comfortable`` of
    usable) is set aside (``more_work``). Of the rest, the fastest whose strategy a trial ran
    on the same devices (``seen``: ``CostModel.trial_layouts``; a real step met its
    estimate, the others' edge is extrapolated and below what the model can tell) if its
    memory is comfortable, else the one with the most memory headroom (an OOM costs more
    than 1 %). Within the wider ``trial_tolerance`` the same rule holds for what a trial ran:
    the model's edge for a plan no trial ran is extrapolated, and the planner bench's picks
    that missed by 16-35 % on 2 CPU ranks were such plans 1-3 % under dp (pp2 GPipe and
    interleaved m=2, mlp and dlrm; 2026-12-05); the closed loop tries them on the job's own
    steps instead (``TryPlan``). Of the plans a trial ran within it, one that keeps every
    rank's state on a peer (``keeps_state``: dp) goes before one that shards it: the model
    cannot order them, and a lost worker then costs the job no rollback (the planner
    bench's pick misses on 2026-12-06 were all zero1 picked 0.5-11 % under dp that ran
    1.06-1.24x dp)."""
    def kept(tol: float) -> list[Candidate]:
        near = [c for c in ranked if c.step_time <= ranked[0].step_time * (1 + tol)]
        easy = [c for c in near if c.peak_fraction <= comfortable]
        return [c for c in near if not any(more_work(c.plan, d.plan) for d in easy)]

    keep = kept(tie_tolerance)
    tried = [c for c in kept(max(tie_tolerance, trial_tolerance))
             if c.peak_fraction <= comfortable and trial_ran(c.plan, seen)]
    if tried:
        return next((c for c in tried if keeps_state(c.plan)), tried[0])
    return min(keep, key=lambda c: c.peak_fraction)


def _peak_fraction(c: Candidate) -> float:
    """Max over devices of predicted bytes / usable bytes (the estimate's ``memory_use``)."""
    assert c.estimate is not None
    return c.estimate.memory_use
