"""What the profiler measured, turned into cost-model terms, with its noise.

Every figure the live profiler reports is a list of repeated timings; ``robust`` reduces one to
its median and spread (the median absolute deviation scaled to a standard deviation, and the
standard error of the median), so a figure can say how sure it is. ``equal_within_noise``
treats devices whose speeds agree within that noise as equal (identical CPUs on a busy host
measure 10-40 % apart from one profile; issue 16 saw shares of [41, 23] from it).

``terms_model`` builds the ``CostModel`` a live job plans with from the per-rank reports of
``elastic``'s ``profile_terms``: each rank's compute (per sample and per pass, from
forward+backward timed at two batch sizes), its optimizer step (per tensor and per element,
plain and as zero3's shards), each collective kind's alpha and beta timed between the live
workers *while they compute* (a collective inside a step waits for busy peers), and the
per-step overhead: what a trial dp step took beyond its terms. The report format is documented
on ``terms_model``. Pure: no torch, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .collectives import (
    BROADCAST_BURST,
    KINDS,
    CommConfig,
    burst_points,
    latency_hops,
    layout_messages,
    sync_points,
    volume_factor,
)
from .cost import CostModel
from .errors import ClustersError
from .estimate import Estimate
from .pipeline_cost import SharedCores
from .pipeline_fit import fit_pipeline
from .plan import Plan
from .profile import ModelProfile
from .spread import Spread, bisect_below, dp_level, robust
from .topology import Cluster

__all__ = ["Spread", "robust", "equal_within_noise", "fit_alpha_beta", "fit_optimizer",
           "fit_pass", "terms_model", "MeasuredModel"]

# the profiler's trial steps with and without the optimizer's update (``more_update_steps``)
UPDATE_WORTH = 0.05  # its timed share of a step below which a factor on it is not chased
UPDATE_MAX_KEPT = 24  # steps of each kind, at most


# the profiler's trial steps of zero1 and zero3 (``more_trial_steps``)
TRIAL_SE = 0.04  # the standard error of a trial's median, relative, to settle for
TRIAL_MAX_KEPT = 8  # steps of the trial's layout, at most (twice the default)


def more_trial_steps(secs: Sequence[float], per_round: int = 2, noise: float = 0.0) -> bool:
    """Whether the profiler should run another round of a layout's trial steps (``secs``:
    its counted seconds so far; ``per_round``: how many another round counts): yes while the
    standard error of their median is over ``TRIAL_SE`` of it and another round stays within
    ``TRIAL_MAX_KEPT``. 4 steps of zero3 on 2 CPU ranks
    (a ViT) came out at 190 and 500 ms, two each: the median, 355 ms, set the per-unit wait,
    and zero3 was predicted +91 % (a wide MLP on 3 ranks: +27 % at a 22 % spread).
    ``noise``: the host's spread per step relative to its median, from a longer run (dp's
    trial): a floor under these few steps' own, which 4 of them under-state when 3 land
    close (mlp's zero1 on 2 CPU ranks: 18.3, 32.4, 19.2, 19.3 ms, a standard error of 2.4 %,
    settled, where dp's 24 trial steps spread 23 %; zero1 was predicted 25 % under its
    job's steps). Above a spread of about 6 % the floor alone keeps a trial going to the
    cap: on a noisy host every such trial runs ``TRIAL_MAX_KEPT`` steps."""
    if not secs or len(secs) + per_round > TRIAL_MAX_KEPT:
        return False
    st = robust(secs)
    floor = noise if math.isfinite(noise) and noise > 0 else 0.0
    return max(st.se, Spread(st.median, floor * st.median, st.n).se) > TRIAL_SE * st.median


def update_differs(in_step: float, se: float, alone: float) -> bool:
    """Whether the update's cost inside a step (``in_step``, with standard error ``se``)
    differs from its ``alone`` timed figure beyond 2 standard errors."""
    return abs(in_step - alone) > 2 * se


def more_update_steps(with_update: Sequence[float], without: Sequence[float],
                      alone: float) -> bool:
    """Whether the profiler should run another pair of blocks of trial steps with and
    without the update (seconds so far of each kind; ``alone``: the update timed by itself).
    Yes while the update is a share of a step worth a factor (``UPDATE_WORTH``), the
    difference is not resolved (neither beyond 2 standard errors of ``alone`` nor known
    within half of it) and fewer than ``UPDATE_MAX_KEPT`` of each kind ran. dlrm on 3 CPU
    ranks: an update of 7.5 ms inside a 20 ms step against 3.9 ms timed, at an sd of 3-5 ms
    per step, failed the test at 6 steps of each kind in 3 runs of 3."""
    n = min(len(with_update), len(without))
    if n == 0 or n >= UPDATE_MAX_KEPT or alone <= 0:
        return False
    w, b = robust(with_update), robust(without)
    if alone < UPDATE_WORTH * w.median:
        return False
    se = math.hypot(w.se, b.se)
    return not (update_differs(w.median - b.median, se, alone) or 2 * se <= alone / 2)


def equal_within_noise(values: Sequence[float], spreads: Sequence[Spread] | None = None,
                       kinds: Sequence[object] | None = None, *, floor: float = 0.1,
                       z: float = 3.0, hosts: Sequence[object] | None = None
                       ) -> tuple[float, ...]:
    """``values`` (speeds) with those that agree within their noise replaced by their group's
    median, so equal devices get equal shares and equal stages.

    Two values agree when they differ by at most ``z`` combined standard errors of their
    medians; devices of one kind (``kinds[i]`` equal: same type, same emulation) also agree
    within ``floor`` (relative), since they are built alike and a persistent difference is the
    closed loop's to find (a straggler), not one profile's. Devices of one kind on one host
    (``hosts[i]`` equal too) always agree: a profile times them at once, and what it sees
    between them is how the host shared its cores, buses and memory during it (3 ranks on
    2 cores measured 172, 377 and 189 samples/s), which the job's synchronous steps even
    out; a profile passes ``hosts``, the closed loop does not. Groups are runs of the sorted
    values in which the smallest and the largest agree; devices that always agree are
    merged first. Returns one value per input.
    """
    n = len(values)
    if n <= 1:
        return tuple(values)
    values = list(values)
    ses = [s.se for s in spreads] if spreads is not None else [0.0] * n
    if kinds is not None and hosts is not None:
        twins: dict[tuple[object, object], list[int]] = {}
        for i, key in enumerate(zip(kinds, hosts, strict=True)):
            if key[1] is not None:
                twins.setdefault(key, []).append(i)
        for group in twins.values():  # one value and one spread: they stay together below
            mid = statistics.median(values[i] for i in group)
            finite = [ses[i] for i in group if math.isfinite(ses[i])]
            se = statistics.median(finite) if finite else math.inf
            for i in group:
                values[i], ses[i] = mid, se
    kind = list(kinds) if kinds is not None else [None] * n

    def agree(i: int, j: int) -> bool:
        a, b = values[i], values[j]
        if a == b:
            return True
        noise = z * math.hypot(ses[i], ses[j])
        if kinds is not None and kind[i] == kind[j]:
            noise = max(noise, floor * max(a, b))
        return abs(a - b) <= noise

    out = list(values)
    order = sorted(range(n), key=lambda i: values[i])
    start = 0
    while start < n:
        end = start + 1
        while end < n and all(agree(order[k], order[end]) for k in range(start, end)):
            end += 1
        group = order[start:end]
        if len(group) > 1:
            mid = statistics.median(values[i] for i in group)
            for i in group:
                out[i] = mid
        start = end
    return tuple(out)


def _nnls2(rows: Sequence[tuple[float, float]], y: Sequence[float]) -> tuple[float, float]:
    """Least squares of y = a x0 + b x1 with a, b >= 0 (two unknowns, by hand)."""
    s00 = sum(r[0] * r[0] for r in rows)
    s01 = sum(r[0] * r[1] for r in rows)
    s11 = sum(r[1] * r[1] for r in rows)
    t0 = sum(r[0] * v for r, v in zip(rows, y, strict=True))
    t1 = sum(r[1] * v for r, v in zip(rows, y, strict=True))
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        a = (t0 * s11 - t1 * s01) / det
        b = (t1 * s00 - t0 * s01) / det
        if a >= 0 and b >= 0:
            return a, b
    a_only = max(0.0, t0 / s00) if s00 > 0 else 0.0
    b_only = max(0.0, t1 / s11) if s11 > 0 else 0.0

    def err(a: float, b: float) -> float:
        return sum((a * r[0] + b * r[1] - v) ** 2 for r, v in zip(rows, y, strict=True))

    return min(((a_only, 0.0), (0.0, b_only)), key=lambda ab: err(*ab))


def fit_alpha_beta(kind: str, n: int, points: Sequence[tuple[float, float]]
                   ) -> tuple[float, float]:
    """(alpha s per hop, beta s per byte) of ``kind`` over ``n`` ranks from (bytes, seconds)
    points: non-negative least squares on ``collectives``' latency hops and volume."""
    hops, vol = latency_hops(kind, n), volume_factor(kind, n)
    rows = [(hops, vol * b) for b, _ in points]
    return _nnls2(rows, [t for _, t in points])


def fit_optimizer(plain: Sequence[tuple[int, float, float]],
                  sharded: tuple[int, float, float] | None = None
                  ) -> tuple[float, float, float]:
    """(seconds per tensor, per element, per tensor of zero3's shards) of an optimizer step
    from (tensors, elements, seconds) points over plain tensors and one over DTensor shards.
    With one plain point the step is charged per element only."""
    a, b = _nnls2([(float(t), float(e)) for t, e, _ in plain], [s for _, _, s in plain])
    a_sh = a
    if sharded is not None and sharded[0] > 0:
        t, e, s = sharded
        a_sh = max(0.0, (s - b * e) / t)
    return a, b, a_sh


def fit_pass(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per pass, seconds per sample) of forward+backward from (batch, seconds) points
    (non-negative least squares)."""
    return _nnls2([(1.0, float(b)) for b, _ in points], [t for _, t in points])


@dataclass(frozen=True)
class MeasuredModel:
    """What ``terms_model`` made of the profiler's reports: the cost model and profile the
    planner uses, the per-rank speeds before and after ``equal_within_noise``, and every
    figure's spread (for events and the benchmark)."""

    model: CostModel
    profile: ModelProfile
    speeds: tuple[float, ...]
    raw_speeds: tuple[float, ...]
    spreads: Mapping[str, Any]


def _rank_compute(rep: Mapping[str, Any]) -> tuple[float, float, Spread]:
    """(seconds per pass, seconds per sample, spread of the per-sample figure) of one rank."""
    pts = [(int(b), robust(ts).median) for b, ts in zip(rep["compute"]["batches"],
                                                       rep["compute"]["seconds"], strict=True)]
    if len({b for b, _ in pts}) > 1:
        f, c = fit_pass(pts)
    else:
        f, c = 0.0, pts[0][1] / max(1, pts[0][0])
    b1, ts1 = int(rep["compute"]["batches"][0]), rep["compute"]["seconds"][0]
    if c <= 0 or f >= robust(ts1).median:  # no per-sample slope (a pass-bound model, noise):
        f = 0.0  # the whole pass per sample, never a near-zero time (an "infinite" speed)
    per = robust([max(1e-12, t - f) / b1 for t in ts1])
    return f, c if c > 0 and f > 0 else per.median, per


def terms_model(reports: Sequence[Mapping[str, Any]], ids: Sequence[str], base: ModelProfile,
                *, kinds: Sequence[object] | None = None, comm: CommConfig | None = None,
                cluster: Cluster | None = None, floor: float = 0.1,
                hosts: Sequence[object] | None = None,
                shared: Sequence[SharedCores | None] | None = None) -> MeasuredModel:
    """The cost model and profile of the live group from each rank's ``profile_terms`` report
    (``reports[r]`` for device ``ids[r]``). A report holds lists of repeated seconds:

    * ``compute``: ``{"batches": [b1, b2], "seconds": [[...], [...]]}``: forward+backward of
      the whole model (loss included) at two batch sizes;
    * ``blocks``: ``{"batch": b, "seconds": [[...] per block], "boundary_bytes": [...],
      "tensors": [[numel, ...] per block]}``;
    * ``optimizer``: ``{"plain": [[tensors, elements, [...]], ...], "sharded": [tensors,
      elements, [...]] | None}``;
    * ``collectives``: ``{kind: [[bytes, [...]], ...]}`` (rank 0's view is used) and
      ``world``; ``broadcast_burst``'s seconds are a whole burst's: ``world`` broadcasts of
      ``bytes`` each, one from every rank, all in flight at once (fitted per message);
    * ``trial``: seconds of real dp steps (the strategy, the step loop's data fetch and
      control all-reduce) with ``shares`` (``{"shares": [...], "seconds": [...]}``);
      optional;
    * ``trial_no_update``: the same steps with an optimizer step that does nothing;
      optional. The difference is the optimizer's cost inside a step, which scales its
      timed-alone figures (``_fit_update``);
    * ``trial_zero1``, ``trial_zero3``: seconds of that layout's real steps (``shares``,
      ``seconds``) and of dp's in rotation with them (``dp_seconds``, optional: each is then
      taken at the dp trial's level, ``spread.dp_level``); optional. They set the wait at
      zero1's broadcast burst (``_fit_burst``) and at zero3's units (``_fit_unit_wait``);
    * ``trial_pipeline``: ``clusters.pipeline_fit.fit_pipeline``'s runs; optional.

    Speeds that agree within their noise are equalized (``equal_within_noise``; ``kinds``
    marks devices built alike, ``hosts`` the host each one is on; ``shared`` says how a
    crowded host's cores were shared among its ranks, for pipelines). The trial dp steps (with
    the dp steps beside the other trials, ``_beside_dp``) set ``step_overhead`` to what they
    took beyond the model's terms, or, when the terms already
    exceed it, the overlap of communication with backward that makes them meet. ``cluster``
    (the live one) is needed for that. Raises ``ClustersError`` on a malformed report.
    """
    if len(reports) != len(ids) or not reports:
        raise ClustersError(f"{len(reports)} profile reports for {len(ids)} devices")
    try:
        per_rank = [_rank_compute(r) for r in reports]
    except (KeyError, IndexError, TypeError) as e:
        raise ClustersError(f"malformed profile report ({e}); expected compute.batches/seconds"
                            ) from None
    raw = tuple(1.0 / c for _, c, _ in per_rank)
    spreads = [Spread(1.0 / s.median, s.sd / s.median ** 2, s.n) for _, _, s in per_rank]
    speeds = equal_within_noise(raw, spreads, kinds, floor=floor, hosts=hosts)
    sps = {i: 1.0 / v for i, v in zip(ids, speeds, strict=True)}
    nb = base.n_blocks
    passes = statistics.median(f for f, _, _ in per_rank) / max(1, nb)

    blocks = reports[0].get("blocks") or {}
    kw: dict[str, Any] = {}
    secs: dict[str, tuple[float, ...]] = {}
    for i, r in zip(ids, reports, strict=True):
        bl = r.get("blocks") or {}
        if len(bl.get("seconds", ())) == nb:
            b = max(1, int(bl.get("batch", 1)))
            secs[i] = tuple(robust(ts).median / b for ts in bl["seconds"])
    if secs:
        kw["block_seconds"] = secs
    if len(blocks.get("boundary_bytes", ())) == nb:
        kw["boundary_bytes"] = tuple(float(x) for x in blocks["boundary_bytes"])
    tensors = blocks.get("tensors")
    if tensors and len(tensors) == nb and all(
            sum(ts) == p for ts, p in zip(tensors, base.block_params, strict=True)):
        kw["block_tensors"] = tuple(tuple(int(t) for t in ts) for ts in tensors)
    profile = replace(base, **kw)

    opt: dict[str, tuple[float, float, float]] = {}
    for i, r in zip(ids, reports, strict=True):
        o = r.get("optimizer")
        if not o or not o.get("plain"):
            continue
        plain = [(int(t), float(e), robust(ts).median) for t, e, ts in o["plain"]]
        sh = o.get("sharded")
        sharded = (int(sh[0]), float(sh[1]), robust(sh[2]).median) if sh else None
        opt[i] = fit_optimizer(plain, sharded)

    coll, cspread, wait, burst_wait = _collectives(reports[0])
    model = CostModel(seconds_per_sample=sps, collectives=coll, optimizer_fit=opt,
                      pass_overhead_s=passes, comm=comm or CommConfig(), sync_wait_s=wait,
                      burst_wait_s=burst_wait,
                      shared_cores={i: c for i, c in zip(ids, shared or [None] * len(ids),
                                                         strict=True) if c is not None})
    trial = reports[0].get("trial")
    trial_spread = None
    bare = reports[0].get("trial_no_update")
    bare_spread, opt_scale = None, None
    if trial and trial.get("seconds") and cluster is not None:  # the ranks step together
        own = robust(trial["seconds"])
        if bare and bare.get("seconds"):  # against the steps it alternated with
            bare_spread = robust(bare["seconds"])
            model, opt_scale = _fit_update(
                model, profile, cluster, ids, tuple(trial["shares"]),
                own.median - bare_spread.median, math.hypot(own.se, bare_spread.se))
        # with dp's steps beside the other trials: spread over the whole profile, so that
        # a phase of the host during the dp trial alone does not set every layout's level
        trial_spread = robust([*trial["seconds"], *_beside_dp(reports[0])])
        model = _fit_overhead(model, profile, cluster, ids, tuple(trial["shares"]),
                              trial_spread.median)
    layouts: dict[str, dict[str, Any] | None] = {}  # zero1's and zero3's trial, as fitted
    for name, fit in (("trial_zero1", _fit_burst), ("trial_zero3", _fit_unit_wait)):
        t = reports[0].get(name)
        layouts[name] = None
        if t and t.get("seconds") and cluster is not None and trial_spread is not None:
            level = dp_level(trial_spread, t.get("dp_seconds"))
            sp = robust([x * level for x in t["seconds"]])
            model = fit(model, profile, cluster, ids, tuple(t["shares"]), sp.median)
            layouts[name] = {**sp.as_dict(), "level": level}
    pipes = [p for p in (r.get("trial_pipeline") for r in reports)
             if isinstance(p, Mapping) and isinstance(p.get("runs"), list)]
    pipe_fit = None
    first = reports[0].get("trial_pipeline")
    if pipes and pipes[0] is first and cluster is not None and trial_spread is not None:
        level = dp_level(trial_spread, pipes[0].get("dp_seconds"))
        model, pipe_fit = fit_pipeline(model, profile, cluster, ids, pipes, level)
    fwd = [robust(r["compute"]["forward"]).median / robust(r["compute"]["seconds"][0]).median
           for r in reports if r["compute"].get("forward")]
    return MeasuredModel(model, profile, speeds, raw, {
        "compute_s_per_sample": [s.as_dict() for _, _, s in per_rank],
        "forward_fraction": statistics.median(fwd) if fwd else None,
        "collectives": cspread,
        "trial": trial_spread.as_dict() if trial_spread else None,
        "sync_wait": model.sync_wait_s, "unit_wait": model.unit_wait_s,
        "burst_wait": model.burst_wait_s,
        **layouts,
        "trial_no_update": bare_spread.as_dict() if bare_spread else None,
        "trial_pipeline": pipe_fit,
        "optimizer_scale": opt_scale,
        "step_overhead": model.step_overhead, "overlap": model.overlap})


def _beside_dp(rep: Mapping[str, Any]) -> list[float]:
    """The seconds of dp's steps run in rotation beside the other trials of one rank's
    report (their ``dp_seconds``), which count with the dp trial's own (``terms_model``):
    those 6 steps alone set the step overhead and the level of every other trial, and run
    in a slow phase of the host they moved every layout with them (dlrm on 3 CPU ranks: dp
    +23 %, zero3 +24 %, the pipeline +60 % before any step; resnet on 2: +51 to +97 %), in
    a fast one every layout came out low (-11 to -13 %; the planner bench, 2026-12-05)."""
    out: list[float] = []
    for name in ("trial_zero1", "trial_zero3", "trial_pipeline"):
        t = rep.get(name)
        xs = t.get("dp_seconds") if isinstance(t, Mapping) else None
        try:
            out += [float(x) for x in xs] if isinstance(xs, list) else []
        except (TypeError, ValueError):
            continue
    return out


def _collectives(rep: Mapping[str, Any]) -> tuple[dict[str, tuple[float, float]],
                                                  dict[str, Any], float, float | None]:
    """(alpha, beta) per kind, the spreads, the wait at a meeting point and the wait at a
    broadcast burst (None: no burst measured) from one rank's report. With both series
    (``collectives`` right after compute, ``collectives_idle`` right after another
    collective): each kind's alpha-beta from the idle series, and the wait = the median over
    the collective kinds of (loaded - idle) at the smallest size, where the message itself is
    nearly all latency. Point-to-point too is charged idle: a pipeline's waits for the
    previous stage's compute are its schedule's (the bubble), and the loaded figure on each
    of its sends counted them again (pp3 on the MLP predicted +65 %). With the loaded series
    only: its alpha-beta, no wait (the wait is then charged with every message).

    ``broadcast_burst``: its seconds over its ``world`` messages are fitted per message; its
    own (loaded - idle) is the wait at zero1/zero2's burst (``burst_wait_s``), kept out of
    the kinds' median: the whole burst meets once, and rank 0, whose view this is, receives
    every other rank's chunk in it."""
    loaded = rep.get("collectives") or {}
    idle = rep.get("collectives_idle") or {}
    world = int(rep.get("world", 2))
    coll: dict[str, tuple[float, float]] = {}
    cspread: dict[str, Any] = {}
    waits: list[float] = []
    burst_wait: float | None = None
    for kind, pts in loaded.items():
        if kind not in KINDS or not pts:
            continue
        n = world if kind != "p2p" else 2
        msgs = max(1, world) if kind == BROADCAST_BURST else 1
        src = idle.get(kind)
        med = [(float(b), robust(ts).median / msgs) for b, ts in (src or pts)]
        coll[kind] = fit_alpha_beta(kind, n, med)
        cspread[kind] = [robust(ts).as_dict() | {"bytes": b} for b, ts in pts]
        if kind == BROADCAST_BURST:
            burst_wait = 0.0
        if src:
            cspread[kind + "_idle"] = [robust(ts).as_dict() | {"bytes": b} for b, ts in src]
            lo, hi = min(src, key=lambda p: p[0])[1], min(pts, key=lambda p: p[0])[1]
            wait = max(0.0, robust(hi).median - robust(lo).median)
            if kind == BROADCAST_BURST:
                burst_wait = wait
            elif kind != "p2p":
                waits.append(wait)
    return coll, cspread, statistics.median(waits) if waits else 0.0, burst_wait


def _fit_unit_wait(model: CostModel, profile: ModelProfile, cluster: Cluster,
                   ids: Sequence[str], shares: tuple[int, ...], measured: float) -> CostModel:
    """``model`` with ``unit_wait_s`` set so that the zero3 plan with ``shares`` predicts the
    ``measured`` trial step (never below 0): what zero3 took beyond its terms is put on its
    per-unit meeting points, the term of it the profiler measures least directly. A trial
    below the terms without any wait: zero3's gathers and reduce-scatters cost less in its
    steps than timed alone (``comm_scale``, down to a quarter); a bag of words on 3 CPU
    ranks measured 104 ms in its trial and was predicted 151. Either way a real step
    validated zero3's kinds (``trial_kinds``): the closed loop's re-fit of a pipeline pick
    had scaled all-gathers by its one small batch all-gather (x2 to x9.8) and predicted
    zero3 +46 to +188 %."""
    plan = Plan(strategy="zero3", world_size=len(ids), shares=shares, devices=tuple(ids))
    if sync_points("zero3", len(ids), profile.units) <= 0:
        return model
    model = replace(model, trial_kinds=tuple(sorted({*model.trial_kinds, *ZERO3_KINDS})))
    fitted = _meet(model, plan, cluster, profile, measured,
                   lambda m, w: replace(m, unit_wait_s=w), ZERO3_KINDS)
    if not _met(fitted.estimate(plan, cluster, profile).step_time, measured):
        return fitted  # (a near tie is not given to what its trial did not meet)
    return replace(fitted, trial_layouts=(*fitted.trial_layouts, ("zero3", tuple(ids))))


ZERO3_KINDS = ("all_gather", "reduce_scatter")  # what zero3's units send


def _fit_burst(model: CostModel, profile: ModelProfile, cluster: Cluster,
               ids: Sequence[str], shares: tuple[int, ...], measured: float) -> CostModel:
    """``model`` with ``burst_wait_s`` set so that the zero1 plan with ``shares`` predicts
    the ``measured`` trial step (never below 0): what zero1 took beyond its terms is put on
    the wait at its broadcast burst, the one meeting point dp does not have, where every
    rank waits for the last owner's update. A trial below the terms without that wait: the
    burst's broadcasts cost less in its steps than timed alone (``comm_scale``, down to a
    quarter). From the terms alone, zero1's step less dp's was predicted 2-6 ms too high in
    6 of 8 model families on 3 CPU ranks (the planner bench, 2026-12-05), where its steps
    measured within 2.3 ms of dp's. zero2 sends the same messages. Where the fit meets the
    trial (within ``MET``), a real step validated zero1's estimate (``trial_layouts``: a near
    tie can go to it) and the burst's cost (``trial_kinds``: the closed loop puts what a
    running zero1 or zero2 segment takes beyond it on the host's drift, as for zero3's
    kinds, not on the burst: with one segment seen, a 7 % drift would have multiplied a 1 ms
    burst and moved zero1 and zero2 alone). Where it does not (the rest of the gap in the
    owners' update or the all-reduce), neither."""
    plan = Plan(strategy="zero1", world_size=len(ids), shares=shares, devices=tuple(ids))
    if burst_points("zero1", len(ids)) <= 0:
        return model
    fitted = _meet(model, plan, cluster, profile, measured,
                   lambda m, w: replace(m, burst_wait_s=w), (BROADCAST_BURST,))
    if not _met(fitted.estimate(plan, cluster, profile).step_time, measured):
        return fitted
    return replace(fitted, trial_kinds=tuple(sorted({*fitted.trial_kinds, BROADCAST_BURST})),
                   trial_layouts=(*fitted.trial_layouts, ("zero1", tuple(ids))))


def _meet(model: CostModel, plan: Plan, cluster: Cluster, profile: ModelProfile,
          measured: float, wait: Callable[[CostModel, float], CostModel],
          kinds: Sequence[str]) -> CostModel:
    """``model`` with a wait (``wait(model, seconds)`` sets it, >= 0) so that ``plan``
    predicts the ``measured`` trial step; where the plan's terms alone already exceed it, no
    wait and ``kinds``' messages scaled down to meet it (``comm_scale``, a quarter at
    least)."""
    bare = wait(model, 0.0)
    if bare.estimate(plan, cluster, profile).step_time > measured:
        def scaled(f: float) -> CostModel:
            return replace(bare, comm_scale={**bare.comm_scale, **{
                k: bare.comm_scale.get(k, 1.0) * f for k in kinds}})

        return scaled(bisect_below(lambda f: scaled(f).estimate(plan, cluster, profile)
                                   .step_time, measured, 0.25, 1.0))
    return wait(model, bisect_below(
        lambda w: wait(model, w).estimate(plan, cluster, profile).step_time,
        measured, 0.0, max(1e-3, measured)))


MET = 0.02  # a fit within 2 % of its trial step met it


def _met(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= MET * measured


def _fit_update(model: CostModel, profile: ModelProfile, cluster: Cluster,
                ids: Sequence[str], shares: tuple[int, ...], in_step: float, se: float
                ) -> tuple[CostModel, float | None]:
    """``model`` with its measured optimizer figures scaled so that the dp plan with
    ``shares`` charges ``in_step`` seconds for the update (a trial step with the update less
    one without, with standard error ``se``), and the factor. Inside a step the update also
    costs what it evicts from the caches the next forward would use; timed alone it does
    not. Within 2 standard errors of the timed figure the factor is 1 (where the update is a
    small part of a noisy step the difference is noise); else at most 4x and never negative.
    Unchanged (None) without a measured optimizer."""
    plan = Plan(strategy="dp", world_size=len(ids), shares=shares, devices=tuple(ids))
    alone = model.estimate(plan, cluster, profile).optimizer
    if not model.optimizer_fit or alone <= 0:
        return model, None
    if not update_differs(in_step, se, alone):
        return model, 1.0
    f = min(4.0, max(0.0, in_step / alone))
    return replace(model, optimizer_fit={k: (a * f, b * f, c * f) for k, (a, b, c) in
                                         model.optimizer_fit.items()}), f


def _fit_overhead(model: CostModel, profile: ModelProfile, cluster: Cluster,
                  ids: Sequence[str], shares: tuple[int, ...], measured: float) -> CostModel:
    """``model`` with ``step_overhead`` set so that the dp plan with ``shares`` predicts the
    ``measured`` trial step; when the trial was faster than the terms, ``overlap`` hides
    communication first, then compute and the optimizer are scaled down to meet it."""
    plan = Plan(strategy="dp", world_size=len(ids), shares=shares, devices=tuple(ids))
    est: Estimate = model.estimate(plan, cluster, profile)
    g, tensors = profile.grad_bytes, profile.tensors(range(profile.n_blocks))
    sent = layout_messages("dp", len(ids), [t * g for t in tensors], comm=model.comm)
    model = replace(model, trial_kinds=tuple(sorted({m.kind for m in sent})),
                    trial_layouts=(("dp", tuple(ids)),))
    gap = measured - est.step_time
    if gap >= 0:
        return replace(model, step_overhead=gap)
    hide = min(est.comm, -gap)  # communication hidden behind backward
    rest = -gap - hide
    # still faster than its terms: compute and the optimizer, each timed in a loop of its own,
    # took less inside a real step; a factor on both (every layout runs them), never a
    # negative cost, at most halving them
    f = max(0.5, 1.0 - rest / max(1e-12, est.compute + est.optimizer)) if rest > 0 else 1.0
    if hide > 0:
        model = replace(model, overlap=min(1.0, hide / max(1e-12, (2 / 3) * est.compute * f)))
    if f == 1.0:
        return model
    return replace(model, seconds_per_sample={k: v * f for k, v in
                                              model.seconds_per_sample.items()},
                   pass_overhead_s=model.pass_overhead_s * f,
                   optimizer_fit={k: (a * f, b * f, c * f) for k, (a, b, c) in
                                  model.optimizer_fit.items()})
