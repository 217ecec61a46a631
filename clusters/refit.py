"""The closed loop's model: the profiled cost model re-fitted to the running job's own steps.

While a job runs, each layout segment it ran gives a measured step time (median and spread
over its steps) and each rank its own compute time per sample (the seconds inside its blocks).
``refit`` folds them into the cost model the planner uses:

1. each rank's seconds per sample become its measured compute (ranks of one kind whose figures
   agree within the noise made equal, as at profiling). The live controller takes its
   figures to the model's scale first (``LiveScale``). A figure per sample holds the rank's
   fixed costs per pass (launches, Python) spread over its share: its figure over the
   model's is how much slower it runs in both, or, where it ran at several shares, in each
   apart (``rank_compute.fit_compute``), so a share re-cut to a few samples is predicted as
   it runs;
2. what each observed layout took beyond the model's terms, re-predicted with those speeds, is
   put on its messages of the kinds the profiler's trial steps did not send
   (``CostModel.trial_kinds``: dp's all-reduce, whose cost a real step validated): a factor
   per collective kind (``CostModel.comm_scale``), fitted by least squares over the layouts
   seen, pulled toward 1 where they say little. The profiler measured compute, the optimizer
   and the per-step overhead (a trial dp step) directly; a layout that is slower than
   predicted is so in what no trial step checked, its own messages, which other layouts share
   only as far as they send the same kinds. So 50 slow steps of zero2 raise its broadcasts'
   cost, not dp's all-reduce, and dp can win the next decision;
   The solve is linear and an estimate is not (a pipeline stage takes the larger of its
   messages and its work): the factors go only as far along the solved step as meets the
   segments best;
3. what is left (a layout with no unchecked kind, such as dp itself, or the factors at 0)
   becomes the per-step overhead, the median over the layouts seen: the drift of the machine
   since profiling, shared by every layout, never below 0 (an over-prediction is a factor,
   which the candidates' levels carry).
   Fitted on dp alone, a residual used to land on the all-reduce factor and made zero1,
   which sent an all-reduce per tensor, +1722 %.

``predictions`` then lists every candidate plan with its predicted step: a layout the job ran
is predicted by its own measured median (the best figure there is), any other by the re-fitted
model. ``observe`` turns a window of the running layout into the ``ReplanObservation`` that
``clusters.policy.ReplanPolicy`` decides on: the live controller (``elastic.control.replan``)
and the simulator (``clusters.sim_replan``) both build it here. Pure: no clock, no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from strategies.traits import TRAITS

from .balance import recut_shares, resplit_stages
from .candidates import model_states, pass_caps
from .collectives import KINDS, SYNC_MODES
from .cost import CostModel
from .errors import BalanceError, ClustersError
from .measured import Spread
from .plan import Plan, more_work
from .planner import plan as plan_fn
from .policy import ReplanObservation
from .profile import ModelProfile
from .rank_compute import (
    LiveScale,
    RankPoint,
    StageBaseline,
    carried,
    fit_compute,
    fixed_fractions,
    fixed_per_sample,
    peer_ratios,
    rank_blocks,
    rank_points,
    slowdowns,
    slowness,
    stage_fractions,
    whole_figures,
)
from .topology import Cluster

# (the ranks' figures live in ``rank_compute``; named here too, where the loop's callers
# have always found them)
__all__ = ["Observed", "plan_key", "refit", "fit_compute", "RankPoint", "rank_points",
           "slowdowns", "fixed_per_sample", "LiveScale", "StageBaseline", "peer_ratios",
           "slowness", "carried", "rank_blocks", "stage_fractions", "Prediction",
           "predictions", "Observation", "observe"]


@dataclass(frozen=True)
class Observed:
    """A layout the job ran: the plan (devices set) and its measured step time."""

    plan: Plan
    step: Spread


def refit(model: CostModel, profile: ModelProfile, cluster: Cluster,
          observed: Sequence[Observed], compute: Mapping[str, Spread] | None = None,
          kinds: Mapping[str, object] | None = None,
          fixed: Mapping[str, float] | None = None,
          points: Mapping[str, Sequence[RankPoint]] | None = None,
          stragglers: Collection[str] = ()) -> CostModel:
    """``model`` re-fitted to ``observed`` segments and per-device ``compute`` (seconds per
    sample of the whole model, by device id; see the module docstring). ``fixed``,
    ``points`` and ``stragglers``: ``fit_compute``'s."""
    out = fit_compute(model, profile, cluster, compute, kinds, fixed, points, stragglers)
    return _fit_comm(out, profile, cluster, observed) if observed else out


def _fit_comm(model: CostModel, profile: ModelProfile, cluster: Cluster,
              observed: Sequence[Observed], pull: float = 0.1) -> CostModel:
    """Per-kind factors on the messages' cost, then the per-step overhead (step 2 and 3 of
    the module docstring). ``pull``: how strongly a factor is held at 1 (relative to the
    largest time of its kind)."""
    from .calibrate import _solve

    rows: list[dict[str, float]] = []
    resid: list[float] = []
    free = [k for k in KINDS if k not in model.trial_kinds]
    for o in observed:
        full = model.estimate(o.plan, cluster, profile).step_time
        parts = {}
        for k in free:
            without = replace(model, comm_scale={**model.comm_scale, k: 0.0})
            c = full - without.estimate(o.plan, cluster, profile).step_time
            if c > 0:
                parts[k] = c
        rows.append(parts)
        resid.append(o.step.median - full)
    kinds = sorted({k for r in rows for k in r})
    scale = dict(model.comm_scale)
    if kinds:
        a = [[r.get(k, 0.0) for k in kinds] for r in rows]
        y = list(resid)
        for j, k in enumerate(kinds):  # ridge rows: delta_k ~ 0 unless the data say so
            w = pull * max(r.get(k, 0.0) for r in rows)
            a.append([w if i == j else 0.0 for i in range(len(kinds))])
            y.append(0.0)
        delta = _solve(a, y)
        base = dict(scale)

        def at(lam: float) -> CostModel:
            return replace(model, comm_scale={**base, **{
                k: max(0.0, base.get(k, 1.0) * (1.0 + lam * d))
                for k, d in zip(kinds, delta, strict=True)}})

        def sq(lam: float) -> float:
            return sum((o.step.median - at(lam).estimate(o.plan, cluster, profile).step_time)
                       ** 2 for o in observed)

        # the solve is linear, an estimate is not (a stage's time is the larger of its
        # messages and its work): the step along the solved factors that meets the segments
        # best, never past them (mlp on 2 ranks, a pipeline pick: p2p x21 overshot, and the
        # overhead that took the rest made zero3's prediction negative)
        scale = dict(at(min((i / 20 for i in range(21)), key=sq)).comm_scale)
    out = replace(model, comm_scale=scale)
    left = [o.step.median - out.estimate(o.plan, cluster, profile).step_time
            for o in observed]
    # the machine's drift since profiling, shared by every layout; never below 0: where the
    # model over-predicts, it is off by a factor (its compute's scale), which the candidates'
    # levels carry (``_levels``); as a negative cost it came off every layout whole (its
    # floor was -0.5 x the fastest segment: -80 ms beside a 238 ms step, and dp at a re-cut
    # to a quarter of the compute was put at 14 ms against 84)
    floor = 0.0
    drift = statistics.median(left)
    pipe = model.pipe_step_overhead  # a pipeline's own fixed cost (pipeline_fit) moves alike
    return replace(out, step_overhead=max(floor, model.step_overhead + drift),
                   pipe_step_overhead=None if pipe is None else max(floor, pipe + drift))


@dataclass(frozen=True)
class Prediction:
    """A candidate plan, its predicted step (seconds) and whether that figure was measured
    (the job ran this layout) or modelled."""

    plan: Plan
    step_s: float
    measured: bool


def predictions(model: CostModel, profile: ModelProfile, cluster: Cluster, global_batch: int,
                observed: Sequence[Observed] = (), rank_order: bool = False
                ) -> tuple[Prediction, ...]:
    """Every fitting plan the planner ranks for the whole cluster, fastest first, each with
    its measured median if the job ran it, else the model's prediction (``rank_order``:
    ``planner.plan``'s)."""
    seen = {plan_key(o.plan): o.step.median for o in observed}
    result = plan_fn(cluster, profile, global_batch, model=model, subsets=False,
                     tie_tolerance=0.0, rank_order=rank_order)
    out = []
    for c in result.ranked:
        k = plan_key(c.plan)
        out.append(Prediction(c.plan, seen.get(k, c.step_time), k in seen))
    for o in observed:  # a layout that ran but the planner no longer ranks (shares re-cut)
        if plan_key(o.plan) not in {plan_key(p.plan) for p in out}:
            out.append(Prediction(o.plan, o.step.median, True))
    return tuple(sorted(out, key=lambda p: p.step_s))


def plan_key(p: Plan) -> tuple[object, ...]:
    """What makes two plans the same layout for the loop's figures: strategy, degrees,
    schedule, micro-batches, stage split and shares (the label leaves the last two out)."""
    return (p.strategy, p.pp_degree, p.dp_mode, p.schedule, p.micro_batches, p.virtual_stages,
            p.stage_split, p.shares)


@dataclass(frozen=True)
class Observation:
    """What ``observe`` made of a window: the policy's input, the candidate plans by label
    (what a ``SwitchPlan`` names), the re-fitted model (None when not re-planning), and each
    device's ``RankPoint`` of this window (what the caller keeps for ``observe``'s
    ``points``; none without a model or the ranks' figures)."""

    obs: ReplanObservation
    plans: Mapping[str, Plan]
    model: CostModel | None
    points: Mapping[str, RankPoint] = field(default_factory=dict)


def observe(*, model: CostModel | None, profile: ModelProfile | None, cluster: Cluster | None,
            global_batch: int,
            current: Plan, step: Spread, observed: Sequence[Observed], remaining: int,
            switch_s: float, rank_s: Sequence[float] = (), rank_rel_sd: Sequence[float] = (),
            kinds: Mapping[str, object] | None = None, replan: bool = True,
            stage_s: Sequence[float] = (), block_weights: Sequence[float] = (),
            recent: Spread | None = None,
            recut: bool = True, own_split: bool = False, tried_from: str = "",
            recut_from: tuple[tuple[int, ...], float] | None = None,
            tried: Collection[str] = (), drift: float = 0.0,
            switched_from: str = "", rank_order: bool = False,
            points: Mapping[str, Sequence[RankPoint]] | None = None,
            stragglers: Collection[str] = (), least_gain: float = 0.05) -> Observation:
    """The closed loop's view of the running layout ``current`` (devices set), measured at
    ``step`` over its window, with the layouts run before it (``observed``).

    ``replan`` (needs ``model``, ``profile`` and ``cluster``): re-fit ``model`` (``refit``: the layouts' medians, and ``rank_s``, each rank's
    compute seconds per sample, when the layout's ranks each run a share) and rank every
    candidate (``predictions``); else no candidates. ``recut``: offer shares that follow
    ``rank_s`` (share-balanced layouts) and the step they save (``balance.recut_shares``),
    or for a pipeline the stage split that follows ``stage_s`` (each rank's compute seconds
    per sample of its stage's blocks; ``rank_s`` are then ``StageBaseline``'s figures) with
    per-block ``block_weights`` (``balance.resplit_stages``; the step saved: the slowest
    position's share of its time saved, taken off the step).
    ``recent``: the running layout's step over the span ``rank_s`` covers, the re-fit's
    point for it when the ranks' compute re-fits the devices. ``tried_from``: the label ``current`` was tried from (the
    decision after a ``TryPlan``), else "". ``recut_from``: after a ``RecutShares``, the shares
    it left and their measured step. ``tried``: labels a ``TryPlan`` named before (never
    offered again, as when its switch failed). ``drift``: how far the host's phases move a
    layout's figure (``LoopMemory.drift``); ``switched_from``: the layout the last switch
    left (``LoopMemory``). ``rank_order``: the devices' order is their ranks' (live;
    ``planner.plan``). ``points``: each device's ``RankPoint`` of earlier windows (the
    ``points`` of their observations), from which the devices named ``stragglers`` get
    their fixed costs and their work slowed apart (``fit_compute``); the re-cut follows
    them too. ``least_gain``: how much faster than the running step (relative) the re-cut
    must be for the other share-balanced candidates to be judged at its shares (the
    policy's ``min_gain``)."""
    shared = current.strategy in SYNC_MODES and len(rank_s) == len(current.devices)
    piped = (current.is_pipeline and len(rank_s) == len(current.devices)
             and len(stage_s) == len(rank_s))
    if recent is not None and (shared or piped):  # the ranks' span: the step now (a window
        step = recent  # from before a rank slowed held a median the re-cut's saving passed)
    candidates: tuple[tuple[str, float], ...] = ()
    untried: tuple[str, ...] = ()
    ran: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    plans: dict[str, Plan] = {}
    fitted = None
    new: tuple[int, ...] = ()
    new_s = 0.0
    ready = model is not None and profile is not None and cluster is not None
    whole = (whole_figures(current, profile, cluster, rank_s, stage_s)
             if profile is not None and cluster is not None and (shared or piped) else None)
    compute = ({current.devices[r]: Spread(t, 0.0, step.n) for r, t in enumerate(whole)}
               if whole is not None else None)
    here: dict[str, RankPoint] = {}
    computed = model
    if ready and whole is not None:
        assert model is not None and profile is not None and cluster is not None
        fixed = fixed_per_sample(current, model, profile, cluster)
        here = rank_points(current, model, profile, cluster, whole, fixed)
        computed = fit_compute(
            model, profile, cluster, compute, kinds, dict(zip(current.devices, fixed,
                                                              strict=True)),
            {d: [*(points or {}).get(d, ()), pt] for d, pt in here.items()}, stragglers)
    if recut and shared and rank_s:
        try:  # (within what each rank's memory holds, where a model says it)
            new, gain = recut_shares(
                current.shares, rank_s, fixed_fractions(current, computed, profile, cluster),
                _caps(current, model, profile, cluster),
                current.micro_batches if TRAITS[current.strategy].lockstep_micro_batches
                else 1)  # (zero3's micro-batches run on every rank: each share fills them)
            new_s = step.median - gain
        except BalanceError:
            new = ()
    if replan and ready:
        assert model is not None and profile is not None and cluster is not None
        seen = {plan_key(o.plan): o for o in observed  # (the running one is its label's last)
                if o.plan.label != current.label}
        # the devices' compute is of the last steps: the running layout's point (``step``,
        # ``recent`` above) is of the same span (a window from before a rank slowed drove
        # every comm factor to 0: dp predicted at 6 ms against its 2900, a pp4 job taken there)
        seen[plan_key(current)] = Observed(current, step)
        obs_all = list(seen.values())
        assert computed is not None
        fitted = _fit_comm(computed, profile, cluster, obs_all)
        if new and shared:  # on the running layout's footing, as the candidates
            new_s = _on_footing(step.median, current, replace(current, shares=new), fitted,
                                profile, cluster, new_s)
        preds = predictions(fitted, profile, cluster, global_batch, obs_all, rank_order)
        if current.strategy in SYNC_MODES:  # at the re-cut while a straggler is named, where
            # it is ``least_gain`` faster (a re-cut of [63, 1] to [61, 3] is noise: dp was
            # tried at [61, 3] beside zero1 at [63, 1], the strategy and the shares at once)
            at = (new if recent is not None and new
                  and new_s <= step.median * (1 - least_gain) else current.shares)
            preds = _at_running_shares(preds, current, fitted, profile, cluster, at)
        levels = _levels(fitted, profile, cluster, obs_all, current)
        best, plans = _figures(preds, levels)
        best[current.label] = step.median
        plans[current.label] = current
        candidates = tuple(sorted(best.items(), key=lambda kv: kv[1]))
        untried = tuple(lab for lab in _untried(preds, current) if lab not in tried)
        ran = tuple(dict.fromkeys(p.plan.label for p in preds
                                  if p.measured and p.plan.label != current.label))
        # a prediction of another family stands on that family's layouts that ran earlier
        stale = tuple(lab for lab, p in plans.items() if lab not in ran
                      and lab != current.label and _family(p) != _family(current)
                      and _family(p) in levels)
    if new and ready and shared and fitted is None:  # (the same, without a re-plan)
        new_s = _on_footing(step.median, current, replace(current, shares=new), computed,
                            profile, cluster, new_s)
    if recut and piped and block_weights:
        new, new_s = _resplit(current, stage_s, block_weights, step.median)
    obs = ReplanObservation(
        current=current.label, step_s=step.median, step_sd=step.sd, steps=step.n,
        candidates=candidates, remaining=max(0, remaining), switch_s=switch_s,
        rank_s=tuple(rank_s) if shared or piped else (),
        rank_rel_sd=tuple(rank_rel_sd) if shared or piped else (),
        shares=tuple(current.stage_split if current.is_pipeline else current.shares),
        cut="stage split" if current.is_pipeline else "shares", own_split=own_split,
        recut=new, recut_step_s=new_s, untried=untried,
        tried_from=tried_from, recut_from=recut_from[0] if recut_from else (),
        recut_from_s=recut_from[1] if recut_from else 0.0, ran=ran, stale=stale,
        switched_from=switched_from, drift=drift,
        notes=tuple((lab, f"split {list(p.stage_split)}" if p.is_pipeline
                     else f"at shares {list(p.shares)}") for lab, p in plans.items()
                    if lab != current.label and (p.is_pipeline or p.shares != current.shares)))
    return Observation(obs, plans, fitted, here)


def _caps(plan: Plan, model: CostModel | None, profile: ModelProfile | None,
          cluster: Cluster | None) -> list[int | None] | None:
    """The most samples each rank of share-balanced ``plan`` holds (its usable memory less
    the model's states, over a sample's activations, times its micro-batches); None without
    a model. A re-cut that gave one GPU 63 of 64 samples would have run out of its memory."""
    if model is None or profile is None or cluster is None:
        return None
    states = model_states(plan.strategy, plan.world_size, profile).total
    per = pass_caps(profile, states, [model.usable_bytes(cluster.device(d))
                                      for d in plan.devices])
    caps: list[int | None] | None = (None if per is None else
                                     [max(0, c) * plan.micro_batches for c in per])
    # where the running shares pass them, the model does not say how this layout runs (a
    # rank's micro_batch_size splits its share into more passes than the plan counts)
    return None if caps is None or any(c is not None and s > c for s, c in zip(
        plan.shares, caps, strict=True)) else caps


def _on_footing(step_s: float, current: Plan, other: Plan, model: CostModel | None,
                profile: ModelProfile | None, cluster: Cluster | None, default: float) -> float:
    """``other``'s step on the running layout's footing: the running step times the model's
    figure for ``other`` over its figure for ``current`` (``default`` where the model
    cannot price them). The re-cut's saving in the model's seconds came off the measured
    step: a profile that put 10.4 ms of a dp step's 11.7 in compute (its overhead in it)
    gave "predicted 1.0 ms/step against 54.6 ms measured" for a re-cut that measured 17.6."""
    if model is None or profile is None or cluster is None:
        return default
    try:
        now = model.estimate(current, cluster, profile).step_time
        then = model.estimate(other, cluster, profile).step_time
    except ClustersError:
        return default
    return step_s * then / now if now > 0 and then > 0 else default


def _resplit(current: Plan, stage_s: Sequence[float], weights: Sequence[float],
             step_s: float) -> tuple[tuple[int, ...], float]:
    """A pipeline's re-split (``observe``) and its predicted step; ((), 0) for none."""
    pp = current.pp_degree
    pos = [max(t for r, t in enumerate(stage_s) if current.coords(r)[0] == p) for p in range(pp)]
    try:
        new, after = resplit_stages(current.stage_split, weights, pos)
    except BalanceError:
        return (), 0.0
    if new == tuple(current.stage_split):
        return (), 0.0
    # the step follows its slowest position's compute (bounded; an absolute figure from
    # the per-sample times went below 0 where they were off)
    return new, step_s * after / max(pos)


def _at_running_shares(preds: Sequence[Prediction], current: Plan, model: CostModel,
                       profile: ModelProfile, cluster: Cluster, shares: Sequence[int]
                       ) -> tuple[Prediction, ...]:
    """The share-balanced candidates that never ran, at ``shares`` (where they fit there):
    the running layout's, or while a straggler is named their re-cut around it. Another
    strategy is judged on the same batch cut, and the shares are re-cut only on a
    straggler's evidence: re-fitted to 3 ranks sharing 2 cores, whose compute the OS shares
    unevenly from window to window, the planner cut every other strategy's shares anew, and
    zero2 was "predicted 85.7 ms" against zero1's 100.9 measured on the running shares
    (mixer; gpt and mlp alike). With a straggler, a switch carries the re-cut (was: dp at
    the running [32, 32] taken over zero1's re-cut to [60, 4], the straggler's share left
    whole; CI, 2026-12-07)."""
    out = []
    for p in preds:
        if (p.measured or p.plan.strategy not in SYNC_MODES or p.plan.shares == tuple(shares)
                or p.plan.devices != current.devices):
            out.append(p)
            continue
        q = replace(p.plan, shares=tuple(shares))
        try:
            est = model.estimate(q, cluster, profile)
        except ClustersError:
            est = None
        out.append(Prediction(q, est.step_time, False) if est is not None
                   and est.memory_use <= 1.0 else p)
    return tuple(out)


def _family(p: Plan) -> str:
    return "pipeline" if p.is_pipeline else "data-parallel"


def _levels(model: CostModel, profile: ModelProfile, cluster: Cluster,
            seen: Sequence[Observed], current: Plan) -> dict[str, float]:
    """Per family (pipelines, data-parallel layouts): measured over the re-fitted model's
    figure, the median over the layouts of it that ran; the running layout's own for its
    family, and for a family none of which ran."""
    ratios: dict[str, list[float]] = {}
    own = 1.0
    for o in seen:
        m = model.estimate(o.plan, cluster, profile).step_time
        if m > 0:
            ratios.setdefault(_family(o.plan), []).append(o.step.median / m)
            if o.plan == current:
                own = o.step.median / m
    out = {f: statistics.median(r) for f, r in ratios.items()}
    out[_family(current)] = own
    out["*"] = own
    return out


def _loose(p: Plan) -> Plan:
    """``p`` without its shares and stage split: what ``more_work`` compares of two plans
    the re-fitted planner cut apart."""
    return replace(p, shares=(), stage_split=())


def _figures(preds: Sequence[Prediction], levels: Mapping[str, float]
             ) -> tuple[dict[str, float], dict[str, Plan]]:
    """Each candidate label's figure and plan, all on the running layout's footing. A label
    the job ran is its measured median, even where the re-fitted planner now gives that
    strategy other shares (as a new plan it was predicted, and picked at a figure 20 % under
    its own measured one: gpt on 3 CPU ranks went dp, zero2, zero1, dp, zero1, dp, zero2 in
    250 steps). Any other is its prediction times its family's level (``_levels``: measured
    over the re-fitted model's figure, what the re-fit could not explain, taken as common to
    the family: the gain is then the model's, not its error on the layouts that ran; a
    GPipe pipeline was "predicted 24.1 ms" beside its 1F1B twin measured 31.3), never under
    the measured figure of a plan it does all the work of (``more_work``, shares and stage
    split aside)."""
    ran: dict[str, Prediction] = {}
    for p in preds:
        if p.measured and (p.plan.label not in ran or p.step_s < ran[p.plan.label].step_s):
            ran[p.plan.label] = p
    best: dict[str, float] = {lab: p.step_s for lab, p in ran.items()}
    plans: dict[str, Plan] = {lab: p.plan for lab, p in ran.items()}
    for p in preds:
        lab = p.plan.label
        if lab in ran or p.step_s <= 0:  # the re-fit's floor can leave a figure at 0
            continue
        floor = max((q.step_s for q in ran.values()
                     if more_work(_loose(p.plan), _loose(q.plan))), default=0.0)
        v = max(p.step_s * levels.get(_family(p.plan), levels["*"]), floor)
        if v < best.get(lab, float("inf")):
            best[lab], plans[lab] = v, p.plan
    return best, plans


def _untried(preds: Sequence[Prediction], current: Plan) -> tuple[str, ...]:
    """Labels of the predicted (never run) plans the loop may try: not one that does more
    work than another plan (``more_work``: zero2 beside zero1, GPipe beside 1F1B)."""
    ran = {p.plan.label for p in preds if p.measured} | {current.label}
    every = [_loose(p.plan) for p in preds] + [_loose(current)]
    return tuple(dict.fromkeys(
        p.plan.label for p in preds if p.plan.label not in ran
        and not any(more_work(_loose(p.plan), q) for q in every)))
