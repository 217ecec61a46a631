"""The closed loop, simulated step by step: a job plans with a profiled cost model, its steps
take what a *true* model says (with noise), and ``clusters.policy.ReplanPolicy`` decides every
``replan_every`` steps on the observation ``clusters.refit.observe`` builds, exactly as the
live controller (``elastic.control.replan``) does. A device can become slower mid-run (a
straggler); a switch or a re-cut costs ``switch_s``.

What it answers without a cluster: does the loop leave a mis-predicted plan, re-cut around a
straggler, and stay put when nothing pays (``LoopResult.seconds`` against ``static_s``, the
same steps on the first plan throughout). Pure: no clock, no torch; seeded noise.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .cost import CostModel, block_weights
from .measured import robust
from .plan import Plan
from .planner import plan as plan_fn
from .policy import KeepPlan, LoopMemory, RecutShares, ReplanPolicy, SwitchPlan
from .profile import ModelProfile
from .rank_compute import moved, rank_points, whole_figures
from .refit import (
    Observed,
    RankPoint,
    StageBaseline,
    carried,
    fixed_per_sample,
    observe,
    plan_key,
    rank_blocks,
    slowness,
    stage_fractions,
)
from .topology import Cluster, Device

__all__ = ["LoopEvent", "LoopResult", "simulate_loop"]

_WINDOW = 200  # most recent steps of a layout that count (as live)


@dataclass(frozen=True)
class LoopEvent:
    """One decision of the loop: at ``step``, ``decision`` (the policy's class name) on
    ``plan`` (the running plan's label), with the policy's ``reason``."""

    step: int
    decision: str
    plan: str
    reason: str


@dataclass(frozen=True)
class LoopResult:
    """``seconds``: the job's time (steps and re-layouts); ``static_s``: the same steps on
    the first plan, without the loop; ``start`` / ``final``: the first and last plans."""

    seconds: float
    static_s: float
    start: Plan
    final: Plan
    events: tuple[LoopEvent, ...] = field(default_factory=tuple)

    @property
    def changes(self) -> tuple[LoopEvent, ...]:
        return tuple(e for e in self.events if e.decision != "KeepPlan")


def _kind(d: Device) -> tuple[object, ...]:
    """What makes devices alike, as live (``elastic.planning.device_kinds``): the device and
    its emulation."""
    return (d.type.name, (d.slowdown, d.memory_bytes, d.stands_for) if d.emulated else ())


def simulate_loop(cluster: Cluster, profile: ModelProfile, global_batch: int, *,
                  truth: CostModel, profiled: CostModel, steps: int, replan_every: int = 50,
                  switch_s: float = 2.0, noise: float = 0.02, seed: int = 0,
                  slowdowns: Mapping[int, Mapping[str, float | tuple[float, float]]] | None
                  = None,
                  phases: Mapping[int, float] | None = None,
                  policy: ReplanPolicy | None = None, warmup: int = 2,
                  start: Plan | None = None) -> LoopResult:
    """Run ``steps`` steps of a job on ``cluster`` that starts on the plan ``profiled``
    picks. ``truth``: what steps really take (each step's time and each rank's compute get a
    relative Gaussian ``noise``); ``slowdowns[step][device id]``: from that step on the
    device's true compute is that many times slower, in its work and its fixed costs per
    pass alike, or (work, fixed costs) times apart; ``phases[step]``: from that step on,
    every step of every layout, and every rank's compute, takes that many times its true time
    (a shared host's phase).
    The first ``warmup`` steps of every layout are left out of its window, as live.
    ``start``: the first plan (default: the one ``profiled`` picks). A pipeline rank's
    compute is its stage's blocks', compared by ``StageBaseline`` and re-split by the
    profile's block weights, as live."""
    pol = policy or ReplanPolicy()
    rng = random.Random(seed)
    slow = {k: dict(v) for k, v in (slowdowns or {}).items()}
    start = start or plan_fn(cluster, profile, global_batch, model=profiled, subsets=False).plan
    cur, true_model = start, truth
    stages = StageBaseline()
    weights = block_weights(profile)
    window: list[float] = []
    ranks: list[list[float]] = []
    observed: dict[tuple[object, ...], Observed] = {}  # by plan_key, as live
    points: dict[str, dict[tuple[object, ...], RankPoint]] = {}  # each device's, as live
    events: list[LoopEvent] = []
    cache: dict[tuple[object, ...], float] = {}
    fixed: dict[tuple[object, ...], list[float]] = {}
    seconds = static_s = 0.0
    since = 0
    memory = LoopMemory()  # what the next decision checks of the last (as live)
    named: set[str] = set()  # the devices named stragglers at the last decision
    slow_by: dict[str, float] = {}  # how much slower than their peers, at the last decision
    known: dict[str, float] = {}  # what of that the running layout started with (as live)
    unapplied: dict[str, float] = {}  # (``refit.slowness``)
    level = 1.0

    def true_step(p: Plan) -> float:
        key = (p.label, p.shares, p.stage_split)
        if key not in cache:
            cache[key] = true_model.estimate(p, cluster, profile).step_time
        return cache[key]

    for step in range(steps):
        if step in slow:  # slower at everything: its work and its fixed costs per pass
            sps, passes = dict(true_model.seconds_per_sample), dict(true_model.pass_scale)
            for dev, k in slow[step].items():
                work, fixed_k = (k, k) if isinstance(k, (int, float)) else k
                sps[dev] = true_model.sample_time(cluster.device(dev), profile) * work
                passes[dev] = passes.get(dev, 1.0) * fixed_k
            true_model = replace(true_model, seconds_per_sample=sps, pass_scale=passes)
            cache.clear()
            fixed.clear()
        level = (phases or {}).get(step, level)
        t = true_step(cur) * level * max(0.0, 1.0 + rng.gauss(0.0, noise))
        seconds += t
        static_s += true_step(start) * level
        since += 1
        if since <= warmup:
            continue
        window.append(t)
        if plan_key(cur) not in fixed:  # each rank's fixed costs per pass over its samples
            fixed[plan_key(cur)] = [f * x for f, x in zip(  # (on its stage's scale)
                fixed_per_sample(cur, true_model, profile, cluster),
                stage_fractions(cur, profile, cluster), strict=True)]
        per = [(true_model.sample_time(cluster.device(d), profile, rank_blocks(cur, r))
                + fixed[plan_key(cur)][r])
               * level * max(1e-9, 1.0 + rng.gauss(0.0, noise))  # a host phase slows all
               for r, d in enumerate(cur.devices)]
        ranks = ranks or [[] for _ in per]
        for r, x in enumerate(per):
            ranks[r].append(x)
        if since - warmup < replan_every or step + 1 >= steps:
            continue
        spreads = [robust(xs[-replan_every:]) for xs in ranks]  # the ranks as they are now
        key = plan_key(cur)
        memory.note_window(window, pol.min_steps, observed[key].step if key in observed else None,
                           recent=replan_every)
        raw = [s.median for s in spreads]
        rank_s = (stages(cur, raw, known=[known.get(d, 1.0) for d in cur.devices])
                  if cur.is_pipeline else raw)
        slow_ranks = pol.slower(rank_s, [s.rel for s in spreads], cur.is_pipeline)
        lagging = {cur.devices[r] for r in slow_ranks}
        recent = max(replan_every, pol.min_steps)
        whole = whole_figures(cur, profile, cluster, rank_s, raw if cur.is_pipeline else ())
        now = rank_points(cur, profiled, profile, cluster, whole) if whole else {}
        if lagging - named or any(moved(points.get(d, {}).get(key), now.get(d))
                                  for d in lagging):  # a device newly slower, or a
            # straggler that moved where it ran before: the other layouts' figures are from
            observed = {k: o for k, o in observed.items() if k == key}  # before it (as live)
            points = {d: {k: p for k, p in by.items() if k == key} for d, by in points.items()}
            memory.forget_last()
        named = lagging
        view = observe(  # while a straggler is named, the re-fit's point of this layout is
            # the span the ranks' figures cover (as live)
            model=profiled, profile=profile, cluster=cluster, global_batch=global_batch,
            current=cur, step=robust(window), remaining=steps - step - 1, switch_s=switch_s,
            observed=list(observed.values()), rank_s=rank_s,
            rank_rel_sd=[s.rel for s in spreads], stage_s=raw if cur.is_pipeline else (),
            kinds={d: _kind(cluster.device(d)) for d in cur.devices},  # as live: by device id
            block_weights=weights, recent=robust(window[-recent:]) if lagging else None,
            points={d: [p for k, p in by.items() if k != key] for d, by in points.items()},
            stragglers=sorted(lagging), least_gain=pol.min_gain,
            **memory.observe_args(cur.label, cur.stage_split))
        for d, pt in view.points.items():  # (as live)
            points.setdefault(d, {})[key] = pt
        decision = pol.decide(view.obs)
        memory.after(decision, cur.label, view.obs.shares, robust(window[-replan_every:]).median)
        slow_by = slowness(rank_s, slow_ranks, cur.devices, unapplied, 1 + pol.straggler)
        events.append(LoopEvent(step + 1, type(decision).__name__, cur.label, decision.reason))
        if isinstance(decision, KeepPlan):
            window, ranks = window[-_WINDOW:], [xs[-_WINDOW:] for xs in ranks]
            since = warmup  # the next decision after another replan_every steps
            continue
        # a straggler named: the layout's figure is the span the ranks' evidence covers (the
        # whole window holds steps from before the rank slowed, as live)
        kept = robust(window[-recent:] if lagging else window)
        memory.kept(observed[key].step if key in observed else None, kept)
        observed[key] = Observed(cur, kept)  # one per label, the last it ran (as live)
        observed = {k: o for k, o in observed.items() if o.plan.label != cur.label or k == key}
        if isinstance(decision, SwitchPlan):
            cur = view.plans[decision.target]
        elif isinstance(decision, RecutShares) and decision.cut == "stage split":
            cur = replace(cur, stage_split=decision.shares)
        elif isinstance(decision, RecutShares):
            cur = replace(cur, shares=decision.shares)
        seconds += switch_s
        window, ranks, since = [], [], 0
        stages = StageBaseline()  # (a new layout: its first window is the ranks' footing)
        known, unapplied = carried(slow_by, isinstance(decision, RecutShares), cur.is_pipeline)
    return LoopResult(seconds, static_s, start, cur, tuple(events))

