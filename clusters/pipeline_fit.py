"""A pipeline's terms fitted to the profiler's pipeline trial (``clusters.measured.terms_model``
calls ``fit_pipeline``; docs/cost-model.md, Pipelines). Pure."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .collectives import collective_time
from .cost import CostModel
from .errors import ClustersError
from .pipeline_cost import stage_blocks
from .plan import Plan
from .profile import ModelProfile
from .spread import bisect_below, robust
from .topology import Cluster

__all__ = ["fit_pipeline"]


def fit_pipeline(model: CostModel, profile: ModelProfile, cluster: Cluster,
                 ids: Sequence[str], trials: Sequence[Mapping[str, Any]], level: float = 1.0
                 ) -> tuple[CostModel, dict[str, Any] | None]:
    """``model`` with a pipeline's terms fitted to the profiler's pipeline trial (``trials``:
    each rank's; per micro-batch count, the first rank's steps and the slowest rank's
    schedule): the step beyond the schedule sets ``pipe_msg_scale`` (the step's messages
    outside it, 0 to 4, the median over the runs); the schedule's growth from the first
    run's micro-batches to the second's sets ``pipe_action_s`` (per stage and micro-batch,
    a stage never below its compute, at the least free p2p), and the first run's schedule
    then ``pipe_bubble_scale`` (what does not grow with m, 0 to 2). A step outside its
    schedule shorter than ``step_overhead`` and the update sets ``pipe_step_overhead``, and
    shorter than the update alone ``pipe_update_scale`` (0 to 1) too. With one run, the seconds
    per action meet its schedule. Timed apart, the parts missed in opposite directions: on 3
    CPU ranks the messages outside the schedule were predicted +44 to +132 % and the
    schedule -16 to -70 %, and from one micro-batch count to twice it the schedule grew
    faster than m t_max + the bubble (``bench/pipeline_phases.py``). Every figure is taken
    times ``level`` (``spread.dp_level``: to the dp trial's level, from the dp steps run in
    rotation with the pipeline's). Unchanged (None) when the trial is malformed or its plans
    cannot be estimated."""
    t0 = trials[0] if trials else {}
    try:
        ms = sorted({int(r["micro_batches"]) for r in t0["runs"]})
        plans = {m: Plan(strategy="pipeline", world_size=len(ids), shares=(sum(t0["shares"]),),
                         pp_degree=len(ids), micro_batches=m,
                         schedule=str(t0.get("schedule", "1f1b")),
                         stage_split=tuple(int(x) for x in t0["split"]), devices=tuple(ids))
                 for m in ms}
        step = {m: robust([t * level for t in next(r["seconds"] for r in t0["runs"]
                                                  if int(r["micro_batches"]) == m)])
                for m in ms}
        sched = {m: max((robust([t * level for t in r["schedule_seconds"]])
                         for t in trials for r in t["runs"] if _run_at(r, m)),
                        key=lambda sp: sp.median)
                 for m in ms}
        for m in ms:
            model.estimate(plans[m], cluster, profile)
    except (KeyError, TypeError, ValueError, StopIteration, ClustersError):
        return model, None

    # what an earlier fit set is set anew (the fixed parts below are measured without it)
    model = replace(model, pipe_step_overhead=None, pipe_update_scale=1.0)

    def compute(m: int, **kw: Any) -> float:
        return replace(model, **kw).estimate(plans[m], cluster, profile).compute

    factors, beyond = [], []
    for m in ms:
        est = model.estimate(plans[m], cluster, profile)
        bare = replace(model, pipe_msg_scale=0.0).estimate(plans[m], cluster, profile)
        # the step outside its schedule (which runs on every rank at once), beyond the
        # update, the dp sync and the step overhead
        beyond.append(step[m].median - sched[m].median - (bare.step_time - bare.compute))
        if est.step_time > bare.step_time:
            factors.append(beyond[-1] / (est.step_time - bare.step_time))
    scale = min(4.0, max(0.0, statistics.median(factors))) if factors else 1.0
    # Less than that: no messages, and a smaller fixed cost than dp's trial left (a bag of
    # words on 3 CPU ranks: 16.8 ms outside the schedule against dp's 13.5 ms overhead and
    # an 18.4 ms update, the pipeline predicted +38 %; its ranks do not all update at once)
    # Less than the update alone too: the stages update as their own backward ends (the
    # last first, while the first still drains), a factor on the update takes the rest
    short = statistics.median(beyond)
    fixed = model.step_overhead + short if short < 0 else None
    upd = 1.0
    update = bare.optimizer  # the stages' update: alike at every count
    if fixed is not None and fixed < 0:
        upd = max(0.0, 1.0 + fixed / update) if update > 0 else 1.0
        fixed = 0.0
    model = replace(model, pipe_msg_scale=0.0 if fixed is not None else scale,
                    pipe_step_overhead=fixed, pipe_update_scale=upd,
                    pipe_fit_schedule=plans[ms[0]].schedule, pipe_fit_reach=max(ms) / len(ids))
    m1, m2 = ms[0], ms[-1]
    hi = max(1e-3, *(sp.median for sp in sched.values()))
    single = replace(model, pipe_action_s=bisect_below(lambda o: compute(m1, pipe_action_s=o),
                                                sched[m1].median, _free_p2p(model, profile,
                                                cluster, ids, plans[m1]), hi))
    fitted = single
    if m2 > m1:  # each term moves both runs: in turns until they settle
        # (from m2's messages, the smaller: below, the growth would fall again with it)
        lo = _free_p2p(model, profile, cluster, ids, plans[m2])
        for _ in range(8):
            act = bisect_below(lambda o: compute(m2, pipe_action_s=o) - compute(m1, pipe_action_s=o),
                        sched[m2].median - sched[m1].median, lo, hi)
            model = replace(model, pipe_action_s=act)
            if compute(m1, pipe_bubble_scale=2.0) <= compute(m1, pipe_bubble_scale=0.0):
                break  # no bubble in what binds (a crowded host's work)
            model = replace(model, pipe_bubble_scale=bisect_below(
                lambda f: compute(m1, pipe_bubble_scale=f), sched[m1].median, 0.0, 2.0))
        met = all(abs(compute(m) - sched[m].median) <= 0.02 * sched[m].median
                  for m in (m1, m2))
        fitted = model if met else single  # else the one run's fit
    return fitted, {"step": step[m1].as_dict(), "schedule": sched[m1].as_dict(),
                    "micro_batches": ms, "schedules": [sched[m].median for m in ms],
                    "steps": [step[m].median for m in ms],
                    "action_s": fitted.pipe_action_s, "bubble_scale": fitted.pipe_bubble_scale,
                    "msg_scale": fitted.pipe_msg_scale, "step_overhead": fitted.pipe_step_overhead,
                    "update_scale": fitted.pipe_update_scale,
                    "level": level}


def _run_at(run: Any, m: int) -> bool:
    """Whether one rank's pipeline trial ``run`` is a well-formed one at ``m`` micro-batches."""
    try:
        return int(run["micro_batches"]) == m and len(run["schedule_seconds"]) > 0
    except (KeyError, TypeError, ValueError):
        return False


def _free_p2p(model: CostModel, profile: ModelProfile, cluster: Cluster, ids: Sequence[str],
              plan: Plan) -> float:
    """The least ``pipe_action_s`` that means anything for ``plan`` (pp = its devices): no
    stage's p2p messages cost anything; below that its stages are at their compute, and the
    fit would take every other plan's messages too."""
    devs = [cluster.device(i) for i in ids]
    b = plan.shares[0] / plan.micro_batches
    return -max((2 * collective_time(
        "p2p", b * profile.boundary(st[-1]), 2,
        *model.alpha_beta(cluster.p2p_path(devs[k], devs[k + 1]), "p2p"))
        for k, st in enumerate(stage_blocks(plan)[:-1])), default=0.0)
