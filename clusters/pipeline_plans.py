"""Pipeline and hybrid candidates for the planner.

Per pp (a divisor of the device count, 2 <= pp <= blocks), schedule and dp_mode, every
micro-batch count m (pp <= m <= max, dividing G, >= dp samples per micro-batch) and two device
arrangements are predicted; the fastest that fits becomes the candidate, else the attempt
closest to fitting gives the rejection reason. Arrangements (rank = stage * dp + replica):
"stages by speed" puts the fastest devices on stage 0 (a stage's replicas are alike, which the
shared stage split needs), "replicas by node" keeps each replica's stages on few nodes.

Each arrangement's ``MeshLayout`` (replicas grouped into classes that cost the same) is built
once and shared by every (schedule, dp_mode, m) tried on it, so the work per candidate grows
with the number of distinct replicas, not with the number of devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .balance import proportional_shares, stage_split
from .candidates import Candidate, PlanContext, too_big
from .errors import BalanceError
from .pipeline_cost import (
    DeviceClasses,
    MeshLayout,
    device_classes,
    mesh_layout,
    pipeline_memory_use,
    pipeline_step_time,
)
from .plan import Plan
from .topology import Device

__all__ = ["pipeline_candidates"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Arrangement:
    """One device order for a pp: its layout, the fastest device (first in rank order; its
    per-block costs shape the split) and each position's slowest whole-model time."""

    name: str
    layout: MeshLayout
    ref: Device
    pos_t: tuple[float, ...]


@dataclass
class _Memo:
    """Per pp, what the (schedule, dp_mode) pairs share: per (arrangement, chunks per rank)
    the stage split and each replica class's speed, and per m too the shares."""

    splits: dict[tuple[str, int], tuple[tuple[int, ...], list[float]]] = field(
        default_factory=dict)
    shares: dict[tuple[str, int, int], tuple[int, ...]] = field(default_factory=dict)


def _arrangements(
    ctx: PlanContext, devs: list[Device], by_speed: list[Device], pp: int,
    classes: DeviceClasses, rank_order: bool = False,
) -> list[_Arrangement]:
    """Layouts for "stages by speed" and (when it differs) "replicas by node"; with
    ``rank_order`` the devices' own order only (``planner.plan``)."""
    dp = len(devs) // pp
    by_node = [devs[r * pp + j] for j in range(pp) for r in range(dp)]
    orders = [("rank order", devs) if rank_order else ("stages by speed", by_speed)]
    if not rank_order and any(a is not b for a, b in zip(by_node, by_speed, strict=True)):
        orders.append(("replicas by node", by_node))
    out = []
    for name, ranks in orders:
        layout = mesh_layout(ctx.model, ctx.cluster, ctx.profile, ranks, pp, classes)
        pos_t = tuple(max(ctx.t(row[j]) for row in layout.rows) for j in range(pp))
        # the first rank on a fastest device (what min(ranks, key=ctx.t) gives, without
        # timing every rank: equal classes time alike)
        t_min = min(ctx.t(d) for row in layout.rows for d in row)
        fastest = {classes.cls[d.id] for row in layout.rows for d in row if ctx.t(d) == t_min}
        ref = next(d for d in ranks if classes.cls[d.id] in fastest)
        out.append(_Arrangement(name, layout, ref, pos_t))
    return out


def _pipeline_plan(
    ctx: PlanContext,
    arr: _Arrangement,
    schedule: str,
    mode: str,
    m: int,
    memo: _Memo,
    subset: str,
) -> Plan:
    """The plan of ``arr`` at ``m``. Its split, replica speeds and shares depend on the
    arrangement, the chunks per rank and ``m`` only, not on the schedule or dp_mode: they are
    kept in ``memo`` (one per pp) and shared by the (schedule, dp_mode) pairs tried."""
    lay = arr.layout
    v = 2 if schedule == "interleaved" else 1
    key = (arr.name, v)
    if key not in memo.splits:
        memo.splits[key] = _split_speeds(ctx, arr, v)
    split, class_speed = memo.splits[key]
    at = (arr.name, v, m)
    if at not in memo.shares:  # a BalanceError propagates (and is raised again next time)
        memo.shares[at] = tuple(map(m.__mul__, proportional_shares(
            ctx.g // m, list(map(class_speed.__getitem__, lay.replica_class)))))
    return Plan(
        strategy="pipeline",
        world_size=len(lay.ids),
        shares=memo.shares[at],
        pp_degree=lay.pp,
        dp_mode=mode,
        micro_batches=m,
        schedule=schedule,
        virtual_stages=v,
        stage_split=split,
        devices=lay.ids,
        reason=f"{subset}: {arr.name}, split by block cost and stage speed",
    )


def _split_speeds(ctx: PlanContext, arr: _Arrangement,
                  v: int) -> tuple[tuple[int, ...], list[float]]:
    """``arr``'s stage split for ``v`` chunks per rank (by the fastest device's per-block
    costs and each position's speed) and each replica class's speed under it."""
    prof, lay = ctx.profile, arr.layout
    pp = lay.pp
    costs = [ctx.model.sample_time(arr.ref, prof, [i]) for i in range(prof.n_blocks)]
    speeds = [ctx.t(arr.ref) / arr.pos_t[k % pp] for k in range(pp * v)]
    split = stage_split(costs, speeds)
    starts = [sum(split[:k]) for k in range(len(split))]
    class_speed = []
    for row in lay.rows:
        per_pos = [0.0] * pp
        for k, b in enumerate(split):
            per_pos[k % pp] += ctx.model.sample_time(row[k % pp], prof,
                                                     range(starts[k], starts[k] + b))
        class_speed.append(1.0 / max(per_pos))
    return split, class_speed


def pipeline_candidates(
    ctx: PlanContext,
    devs: list[Device],
    subset: str,
    schedules: Sequence[str],
    dp_modes: Sequence[str],
    max_pp: int | None,
    rank_order: bool = False,
) -> list[Candidate]:
    """One candidate (or rejection) per (pp, schedule, dp_mode) on ``devs`` (``rank_order``:
    ``planner.plan``'s)."""
    out: list[Candidate] = []
    n, nb = len(devs), ctx.profile.n_blocks
    by_speed = sorted(devs, key=ctx.t)  # stable: node order among equals; stage 0 fastest
    classes = device_classes(ctx.model, ctx.profile, devs)
    deep = [pp for pp in _divisors(n) if pp > max(1, nb) and (max_pp is None or pp <= max_pp)]
    if deep:  # said once per subset, not per degree (was: left out without a word)
        stub = Plan(strategy="pipeline", world_size=n, shares=(ctx.g,), pp_degree=deep[0],
                    micro_batches=1, stage_split=(1,) * deep[0])
        why = ("the model is one block to the planner (not pipeline-ready, or a single "
               "block: strategies/blocks.py; a pipeline job says which)" if nb < 2 else
               f"{', '.join(f'pp{pp}' for pp in deep)}: more stages than the model's {nb} blocks")
        out.append(Candidate(stub, None, f"pipeline: {why}", subset))
    g_divs = [m for m in range(1, min(ctx.g, ctx.max_m) + 1) if ctx.g % m == 0]
    for pp in _divisors(n):
        if pp < 2 or pp > nb or (max_pp is not None and pp > max_pp):
            continue
        dp = n // pp
        arrs: list[_Arrangement] | None = None
        memo = _Memo()
        for schedule in schedules:
            v = 2 if schedule == "interleaved" else 1
            # m < pp only adds bubble and (1F1B) memory, so it is never considered; nor, when
            # the profiler's trial fitted the schedule, m beyond the micro-batches per stage
            # it ran (reach), whose per-micro-batch cost it never measured: convnet on 2 CPU
            # ranks, pp2 1F1B m=32 predicted 82.8 ms, measured 140 (trial at m = 2 and 8);
            # where no count within reach divides G, the whole range as before
            ms = [
                m
                for m in g_divs
                if pp <= m <= ctx.max_m and ctx.g // m >= dp and (v == 1 or m % pp == 0)
            ]
            reach = ctx.model.pipe_fit_reach * pp
            ms = ([m for m in ms if m <= reach] or ms) if reach > 0 else ms
            for mode in dp_modes if dp > 1 else ("dp",):
                stub = Plan(
                    strategy="pipeline",
                    world_size=n,
                    shares=(ctx.g,) * dp,
                    pp_degree=pp,
                    dp_mode=mode,
                    schedule=schedule,
                    virtual_stages=v,
                    micro_batches=1,
                    stage_split=(1,) * (pp * v),
                )
                if pp * v > nb or not ms:
                    why = (
                        f"{pp * v} stages > {nb} blocks"
                        if pp * v > nb
                        else f"no micro-batch count m in [{pp}, {ctx.max_m}] divides G={ctx.g} "
                        f"leaving >= {dp} samples per micro-batch"
                        + (f" (interleaved: m % {pp} == 0)" if v > 1 else "")
                    )
                    label = stub.label.rsplit(" m=", 1)[0]
                    out.append(Candidate(stub, None, f"{label}: {why}", subset))
                    continue
                if arrs is None:
                    arrs = _arrangements(ctx, devs, by_speed, pp, classes, rank_order)
                out.append(_best(ctx, arrs, stub, schedule, mode, ms, memo, subset))
    return out


def _best(
    ctx: PlanContext,
    arrs: list[_Arrangement],
    stub: Plan,
    schedule: str,
    mode: str,
    ms: list[int],
    memo: _Memo,
    subset: str,
) -> Candidate:
    """The fastest fitting (arrangement, m), else the rejection of the attempt closest to
    fitting (a balance failure counts as farthest; ties to the first tried). Each try's
    memory is worked out first and only those that fit are timed (on a cluster whose small
    devices hold none of a large model's tries, timing them all was most of a plan's time);
    the rejection's text is written for the one rejection given."""
    tries: dict[int, tuple[_Arrangement, Plan]] = {}  # by the order tried
    failed: dict[int, str] = {}  # balance failures, by the order tried
    for arr in arrs:
        for m in ms:
            i = len(tries) + len(failed)
            try:
                tries[i] = (arr, _pipeline_plan(ctx, arr, schedule, mode, m, memo, subset))
            except BalanceError as e:
                failed[i] = f"{stub.label}: {e}"
    uses = {i: pipeline_memory_use(ctx.model, p, ctx.profile, arr.layout)
            for i, (arr, p) in tries.items()}
    fits = [i for i, u in uses.items() if u[0] <= 1.0]
    if fits:
        _, i = min((pipeline_step_time(ctx.model, tries[i][1], ctx.profile,
                                       tries[i][0].layout), i) for i in fits)
        arr, p = tries[i]
        est = ctx.model.estimate(p, ctx.cluster, ctx.profile, layout=arr.layout)
        return Candidate(p, est, None, subset)
    # nothing fits: the attempt closest to fitting, the first in the order tried
    pick: int | None = None
    for i in range(len(tries) + len(failed)):
        if i in failed:
            if pick is None:
                pick = i
        elif pick is None or (pick not in failed and uses[i][0] < uses[pick][0]) or (
                pick in failed and uses[i][0] < math.inf):
            pick = i
    assert pick is not None  # ms is never empty
    if pick in failed:
        return Candidate(stub, None, failed[pick], subset)
    arr, p = tries[pick]
    _, tight, at = uses[pick]
    return Candidate(stub, None, too_big(ctx, p.label, at, arr.layout.devices[tight]), subset)
