"""Pipeline and hybrid candidates for the planner. Private to planner.py.

Per pp (a divisor of the device count, 2 <= pp <= blocks), schedule and dp_mode, every
micro-batch count m (pp <= m <= max, dividing G, >= dp samples per micro-batch) and two device
arrangements are predicted; the fastest that fits becomes the candidate, else the attempt
closest to fitting gives the rejection reason. Arrangements (rank = stage * dp + replica):
"stages by speed" puts the fastest devices on stage 0 (a stage's replicas are alike, which the
shared stage split needs), "replicas by node" keeps each replica's stages on few nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .balance import proportional_shares, stage_split
from .errors import BalanceError
from .plan import Plan
from .planner import Candidate, _memory_rejection, _time

if TYPE_CHECKING:
    from .planner import _Ctx
    from .topology import Device

__all__ = ["pipeline_candidates"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _arrangements(ctx: _Ctx, devs: list[Device], pp: int) -> list[tuple[str, list[Device]]]:
    """Device per rank (rank = stage * dp + replica) for two layouts, deduplicated."""
    dp = len(devs) // pp
    by_speed = sorted(devs, key=ctx.t)  # stable: node order among equals; stage 0 fastest
    by_node = [devs[r * pp + j] for j in range(pp) for r in range(dp)]
    out = [("stages by speed", by_speed)]
    if [d.id for d in by_node] != [d.id for d in by_speed]:
        out.append(("replicas by node", by_node))
    return out


def _pipeline_plan(
    ctx: _Ctx,
    ranks: list[Device],
    pp: int,
    schedule: str,
    mode: str,
    m: int,
    splits: dict[tuple[str, int], tuple[int, ...]],
    subset: str,
    arrangement: str,
) -> Plan:
    prof, dp = ctx.profile, len(ranks) // pp
    v = 2 if schedule == "interleaved" else 1
    ref = min(ranks, key=ctx.t)
    pos_t = [max(ctx.t(ranks[j * dp + r]) for r in range(dp)) for j in range(pp)]
    key = (arrangement, v)
    if key not in splits:
        costs = [ctx.model.sample_time(ref, prof, [i]) for i in range(prof.n_blocks)]
        speeds = [ctx.t(ref) / pos_t[k % pp] for k in range(pp * v)]
        splits[key] = stage_split(costs, speeds)
    split = splits[key]
    starts = [sum(split[:k]) for k in range(len(split))]
    rep_speed = []
    memo: dict[tuple[object, ...], float] = {}
    for r in range(dp):
        row = [ranks[j * dp + r] for j in range(pp)]
        keys = tuple(ctx.model.device_key(d, prof) for d in row)
        if keys not in memo:
            per_pos = [0.0] * pp
            for k, b in enumerate(split):
                per_pos[k % pp] += ctx.model.sample_time(
                    row[k % pp], prof, range(starts[k], starts[k] + b)
                )
            memo[keys] = 1.0 / max(per_pos)
        rep_speed.append(memo[keys])
    units = proportional_shares(ctx.g // m, rep_speed)
    return Plan(
        strategy="pipeline",
        world_size=len(ranks),
        shares=tuple(u * m for u in units),
        pp_degree=pp,
        dp_mode=mode,
        micro_batches=m,
        schedule=schedule,
        virtual_stages=v,
        stage_split=split,
        devices=tuple(d.id for d in ranks),
        reason=f"{subset}: {arrangement}, split by block cost and stage speed",
    )


def pipeline_candidates(
    ctx: _Ctx,
    devs: list[Device],
    subset: str,
    schedules: Sequence[str],
    dp_modes: Sequence[str],
    max_pp: int | None,
) -> list[Candidate]:
    out: list[Candidate] = []
    n, nb = len(devs), ctx.profile.n_blocks
    for pp in _divisors(n):
        if pp < 2 or pp > nb or (max_pp is not None and pp > max_pp):
            continue
        dp = n // pp
        arrs = _arrangements(ctx, devs, pp)
        splits: dict[tuple[str, int], tuple[int, ...]] = {}
        for schedule in schedules:
            v = 2 if schedule == "interleaved" else 1
            # m < pp only adds bubble and (1F1B) memory, so it is never considered.
            ms = [
                m
                for m in _divisors(ctx.g)
                if pp <= m <= ctx.max_m and ctx.g // m >= dp and (v == 1 or m % pp == 0)
            ]
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
                best: Candidate | None = None
                first_reject: tuple[float, str] | None = None
                for arr_name, ranks in arrs:
                    for m in ms:
                        try:
                            p = _pipeline_plan(
                                ctx, ranks, pp, schedule, mode, m, splits, subset, arr_name
                            )
                        except BalanceError as e:
                            first_reject = first_reject or (math.inf, f"{stub.label}: {e}")
                            continue
                        est = ctx.model.estimate(p, ctx.cluster, ctx.profile)
                        mem_why = _memory_rejection(ctx, p.label, est, ranks)
                        if mem_why is None:
                            if best is None or est.step_time < _time(best):
                                best = Candidate(p, est, None, subset)
                        else:
                            ratio = max(
                                mm.total / ctx.usable(d)
                                for mm, d in zip(est.memory, ranks, strict=True)
                            )
                            if first_reject is None or ratio < first_reject[0]:
                                first_reject = (ratio, mem_why)
                if best is not None:
                    out.append(best)
                else:
                    assert first_reject is not None
                    out.append(Candidate(stub, None, first_reject[1], subset))
    return out
