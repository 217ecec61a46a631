"""The planner: enumerate plans for a cluster, predict each, reject what does not fit, rank.

Candidates: for each device subset (all devices, then the fastest pools alone, the fastest
two, ... so that "drop the slow pool" is considered), the four dp/ZeRO strategies (with
gradient accumulation when activations need it) and pipelines with pp in the divisors of the
subset size (2 <= pp <= blocks), each schedule, each dp_mode for hybrids, keeping the best
micro-batch count and device arrangement per (pp, dp_mode, schedule). Batch shares follow
device speed (``balance.proportional_shares``), stage splits follow per-block cost and stage
speed (``balance.stage_split``). Pure and deterministic: the same input gives the same table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .balance import proportional_shares
from .cost import CostModel, Estimate, model_state_bytes
from .errors import BalanceError, PlanError
from .plan import DP_MODES, SCHEDULES, STRATEGIES, Plan
from .profile import ModelProfile
from .topology import Cluster, Device

__all__ = ["Candidate", "PlanResult", "plan"]

_GB = 1e9


@dataclass(frozen=True)
class Candidate:
    """A plan with its prediction, or with the reason it was rejected."""

    plan: Plan
    estimate: Estimate | None = None
    rejection: str | None = None
    subset: str = "all devices"
    peak_fraction: float = 0.0  # max over devices of predicted bytes / usable bytes

    @property
    def fits(self) -> bool:
        return self.rejection is None


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
) -> PlanResult:
    """Choose a plan for training ``profile`` with global batch ``global_batch`` on ``cluster``.

    ``optimizer`` (adam, adamw, sgd, sgd_momentum) overrides the profile's optimizer bytes.
    ``speeds``: measured samples/s per device id (the live system's numbers); they replace the
    model's compute estimate for those devices. ``subsets=False`` uses every device.
    Ranking is by predicted step time; among plans within ``tie_tolerance`` of the fastest
    (the model is not that precise) the one with the most memory headroom is chosen.
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
    ctx = _Ctx(cluster, profile, global_batch, model, max_micro_batches)
    cands: list[Candidate] = []
    for label, devs in _subsets(ctx) if subsets else [("all devices", list(cluster.devices))]:
        for s in strategies:
            if s != "pipeline":
                cands.append(_data_parallel(ctx, s, devs, label))
        if "pipeline" in strategies:
            from ._pipeline_plans import pipeline_candidates

            cands.extend(pipeline_candidates(ctx, devs, label, schedules, dp_modes, max_pp))
    fitting = [replace(c, peak_fraction=_peak_ratio(ctx, c)) for c in cands if c.fits]
    ranked = sorted(fitting, key=lambda c: (_time(c), c.peak_fraction))
    rejected = tuple(c for c in cands if not c.fits)
    from .report import explain

    if ranked:
        near = [c for c in ranked if _time(c) <= _time(ranked[0]) * (1 + tie_tolerance)]
        best = min(near, key=lambda c: c.peak_fraction)
        ranked.remove(best)
        ranked.insert(0, best)
    choice = ranked[0] if ranked else None
    text = explain(choice, ranked, rejected, cluster, global_batch)
    if choice is not None:
        choice = replace(choice, plan=replace(choice.plan, reason=text.splitlines()[0]))
        ranked[0] = choice
    emulated = any(d.emulated for d in cluster.devices)
    return PlanResult(choice, tuple(ranked), rejected, text, global_batch, cluster.name, emulated)


class _Ctx:
    def __init__(
        self, cluster: Cluster, profile: ModelProfile, g: int, model: CostModel, max_m: int
    ) -> None:
        self.cluster, self.profile, self.g, self.model, self.max_m = (
            cluster,
            profile,
            g,
            model,
            max_m,
        )
        self._t: dict[str, float] = {}

    def t(self, d: Device) -> float:
        """Whole-model seconds per sample on ``d`` (memoized by device key)."""
        if d.id not in self._t:
            self._t[d.id] = self.model.sample_time(d, self.profile)
        return self._t[d.id]

    def usable(self, d: Device) -> float:
        return self.model.usable_bytes(d)


def _time(c: Candidate) -> float:
    assert c.estimate is not None, "only fitting candidates are timed"
    return c.estimate.step_time


def _peak_ratio(ctx: _Ctx, c: Candidate) -> float:
    assert c.estimate is not None
    return max(
        m.total / ctx.usable(ctx.cluster.device(i))
        for m, i in zip(c.estimate.memory, c.plan.devices, strict=True)
    )


def _subsets(ctx: _Ctx) -> list[tuple[str, list[Device]]]:
    devs = list(ctx.cluster.devices)
    pools: dict[str, list[Device]] = {}
    for d in devs:
        pools.setdefault(d.pool, []).append(d)
    out = [("all devices", devs)]
    if len(pools) < 2:
        return out
    order = sorted(pools, key=lambda p: min(ctx.t(d) for d in pools[p]))
    for k in range(1, len(order)):
        keep = set(order[:k])
        out.append(("only " + "+".join(order[:k]), [d for d in devs if d.pool in keep]))
    return out


def _fmt_gb(x: float) -> str:
    gb = x / _GB
    return f"{gb:.1f} GB" if gb >= 10 else f"{gb:.2f} GB"


def _fmt_cap(d: Device) -> str:
    """A device's memory as its datasheet prints it: ``16 GB``, ``0.5 GB``."""
    gb = d.memory_bytes / _GB
    return f"{gb:.0f} GB" if gb >= 10 or gb == int(gb) else f"{gb:.1f} GB"


def _memory_rejection(ctx: _Ctx, label: str, est: Estimate, devs: Sequence[Device]) -> str | None:
    worst, ratio = None, 0.0
    for m, d in zip(est.memory, devs, strict=True):
        r = m.total / ctx.usable(d)
        if r > ratio:
            worst, ratio = (m, d), r
    if ratio <= 1.0 or worst is None:
        return None
    m, d = worst
    return (
        f"{label}: needs {_fmt_gb(m.total)} per device (states {_fmt_gb(m.model_states)}, "
        f"activations {_fmt_gb(m.activations)}), {d.short} has "
        f"{_fmt_cap(d)} ({_fmt_gb(ctx.usable(d))} usable)"
    )


def _data_parallel(ctx: _Ctx, strategy: str, devs: list[Device], subset: str) -> Candidate:
    n, prof, g = len(devs), ctx.profile, ctx.g
    ids = tuple(d.id for d in devs)
    stub = Plan(strategy=strategy, world_size=n, shares=(1,) * n, devices=ids)
    if g < n:
        return Candidate(stub, None, f"{strategy}: global batch {g} < {n} devices", subset)
    st = model_state_bytes(
        strategy,
        prof.n_params,
        n,
        bytes_per_param=prof.bytes_per_param,
        grad_bytes=prof.grad_bytes,
        optimizer_bytes=prof.optimizer_bytes_per_param,
    )
    big = max(prof.block_params)
    buf = {
        "zero2": big * prof.grad_bytes,
        "zero3": 2 * big * prof.bytes_per_param + big * prof.grad_bytes,
    }.get(strategy, 0.0)
    fixed = st.model_states + buf
    worst = min(devs, key=ctx.usable)
    if fixed > ctx.usable(worst):
        return Candidate(
            stub,
            None,
            (
                f"{strategy}: needs {_fmt_gb(fixed)} per device for model states, {worst.short} has "
                f"{_fmt_cap(worst)} ({_fmt_gb(ctx.usable(worst))} usable)"
            ),
            subset,
        )
    act = sum(prof.stored(i) for i in range(prof.n_blocks))
    speeds = [1.0 / ctx.t(d) for d in devs]
    # Gradient accumulation: m passes of ceil(share / m) samples; try m = 1, 2, 4, ...
    m, tried, shares, err = 1, 1, None, ""
    while m <= ctx.max_m:
        caps = [None if act <= 0 else int((ctx.usable(d) - fixed) // act) * m for d in devs]
        try:
            shares = proportional_shares(g, speeds, caps)
            break
        except BalanceError as e:
            err, tried = str(e), m
            m *= 2
    if shares is None:
        return Candidate(
            stub,
            None,
            f"{strategy}: activations do not fit even with {tried} accumulation steps ({err})",
            subset,
        )
    if m > 1 and strategy in ("zero2", "zero3") and min(shares) < m:
        # each of their micro-batches is a collective on every rank: all ranks run m of them
        return Candidate(
            stub,
            None,
            f"{strategy}: {m} accumulation steps run on every rank, but the slowest device's "
            f"share is {min(shares)} samples",
            subset,
        )
    p = Plan(
        strategy=strategy,
        world_size=n,
        shares=shares,
        micro_batches=m,
        devices=ids,
        reason=f"{subset}: shares by speed" + (f", {m} accumulation steps" if m > 1 else ""),
    )
    est = ctx.model.estimate(p, ctx.cluster, prof)
    return Candidate(p, est, _memory_rejection(ctx, p.label, est, devs), subset)
