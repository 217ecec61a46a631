"""Candidate plans and why one does not fit: what the planner's enumeration is made of.

``PlanContext`` holds one planning call's inputs and memos (whole-model seconds per sample per
device, usable bytes), ``Candidate`` a plan with its prediction or its rejection. The
data-parallel candidates (dp, zero1-3, with gradient accumulation when activations need it)
and the device subsets are enumerated here; pipelines in ``pipeline_plans``; ranking and the
choice in ``planner``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from strategies.traits import TRAITS

from .balance import proportional_shares
from .cost import CostModel
from .errors import BalanceError
from .estimate import Estimate
from .memory import MemoryBreakdown, describe_memory, format_bytes, layout_memory
from .plan import Plan
from .profile import ModelProfile
from .topology import Cluster, Device

__all__ = ["Candidate", "PlanContext", "data_parallel_candidate", "device_subsets",
           "memory_rejection", "format_capacity"]


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

    @property
    def step_time(self) -> float:
        """Predicted seconds per step (only fitting candidates are timed)."""
        assert self.estimate is not None, "only fitting candidates are timed"
        return self.estimate.step_time


class PlanContext:
    """One planning call: cluster, profile, global batch ``g``, cost model, the most
    micro-batches to try, and memos keyed by device id."""

    def __init__(
        self, cluster: Cluster, profile: ModelProfile, g: int, model: CostModel, max_m: int
    ) -> None:
        self.cluster = cluster
        self.profile = profile
        self.g = g
        self.model = model
        self.max_m = max_m
        self._t: dict[str, float] = {}
        self._u: dict[str, float] = {}
        self._per: dict[int, tuple[Sequence[Device], list[float], list[float]]] = {}

    def per_device(self, devs: Sequence[Device]) -> tuple[list[float], list[float]]:
        """Each of ``devs``' speed (samples per second) and usable bytes, worked out once per
        list (the data-parallel strategies share a subset's: 10,000 devices each)."""
        hit = self._per.get(id(devs))
        if hit is None or hit[0] is not devs:
            hit = self._per[id(devs)] = (devs, [1.0 / self.t(d) for d in devs],
                                         list(map(self.usable, devs)))
        return hit[1], hit[2]

    def t(self, d: Device) -> float:
        """Whole-model seconds per sample on ``d`` (memoized by device id)."""
        if d.id not in self._t:
            self._t[d.id] = self.model.sample_time(d, self.profile)
        return self._t[d.id]

    def usable(self, d: Device) -> float:
        """Usable bytes on ``d`` (memoized by device id)."""
        u = self._u.get(d.id)
        if u is None:
            u = self._u[d.id] = self.model.usable_bytes(d)
        return u


def format_capacity(d: Device) -> str:
    """A device's memory as its datasheet prints it: ``16 GB``, ``0.5 GB``."""
    gb = d.memory_bytes / 1e9
    return f"{gb:.0f} GB" if gb >= 10 or gb == int(gb) else f"{gb:.1f} GB"


def memory_rejection(
    ctx: PlanContext, label: str, est: Estimate, devs: Sequence[Device]
) -> str | None:
    """Why ``est`` does not fit (its tightest device, every counted part named), or None."""
    if est.memory_use <= 1.0:
        return None
    return too_big(ctx, label, est.memory[est.tightest_rank], devs[est.tightest_rank])


def too_big(ctx: PlanContext, label: str, m: MemoryBreakdown, d: Device) -> str:
    """``memory_rejection``'s text for ``m`` on its device ``d``."""
    return (
        f"{label}: needs {format_bytes(m.total)} per device = {describe_memory(m)}; "
        f"{d.short} has {format_capacity(d)} ({format_bytes(ctx.usable(d))} usable)"
    )


def device_subsets(ctx: PlanContext) -> list[tuple[str, list[Device]]]:
    """All devices, then the fastest pool alone, the fastest two, ... (``"only a100+l4"``)."""
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


def model_states(strategy: str, n: int, prof: ModelProfile) -> MemoryBreakdown:
    """What each of ``n`` ranks holds of the model under ``strategy`` before any activation
    (``memory.layout_memory``)."""
    return layout_memory(
        strategy,
        prof.n_params,
        n,
        bytes_per_param=prof.bytes_per_param,
        grad_bytes=prof.grad_bytes,
        optimizer_bytes=prof.optimizer_bytes_per_param,
        biggest_block=max(prof.block_params),
        units=prof.units,
        biggest_tensor=prof.biggest_tensor(),
        frozen_params=prof.frozen(),
    )


def pass_caps(prof: ModelProfile, states: float, usable: Sequence[float]) -> list[int] | None:
    """The most samples each device's pass holds: its ``usable`` bytes less the model's
    ``states`` over the activations one sample stores (None where a sample stores none)."""
    act = sum(prof.stored(i) for i in range(prof.n_blocks))
    return None if act <= 0 else [int((u - states) // act) for u in usable]


def data_parallel_candidate(
    ctx: PlanContext, strategy: str, devs: list[Device], subset: str
) -> Candidate:
    """``strategy`` (dp, zero1-3) on ``devs``: shares by speed, capped by the samples each
    device's free memory holds, with m = 1, 2, 4, ... accumulation steps until they fit."""
    n, prof, g = len(devs), ctx.profile, ctx.g
    ids = tuple(map(operator.attrgetter("id"), devs))
    stub = Plan(strategy=strategy, world_size=n, shares=(1,) * n, devices=ids)
    if g < n:
        return Candidate(stub, None, f"{strategy}: global batch {g} < {n} devices", subset)
    fixed_parts = model_states(strategy, n, prof)
    fixed = fixed_parts.total
    speeds, usable = ctx.per_device(devs)
    worst = devs[usable.index(min(usable))]
    if fixed > ctx.usable(worst):
        return Candidate(
            stub,
            None,
            f"{strategy}: needs {format_bytes(fixed)} per device before any activation = "
            f"{describe_memory(fixed_parts)}; {worst.short} has {format_capacity(worst)} "
            f"({format_bytes(ctx.usable(worst))} usable)",
            subset,
        )
    per_pass = pass_caps(prof, fixed, usable)
    # Gradient accumulation: m passes of ceil(share / m) samples; try m = 1, 2, 4, ...
    m, tried, shares, err = 1, 1, None, ""
    while m <= ctx.max_m:
        caps: list[int | None] | None = None if per_pass is None else [c * m for c in per_pass]
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
    if m > 1 and TRAITS[strategy].lockstep_micro_batches and min(shares) < m:
        # each of their micro-batches is a collective on every rank: all ranks run m of them,
        # so every share must fill m; the slow devices get m (more than their speed says)
        try:
            shares = proportional_shares(g, speeds, caps, min_share=m)
        except BalanceError as e:
            return Candidate(
                stub,
                None,
                f"{strategy}: {m} accumulation steps run on every rank, but the slowest "
                f"device's share is {min(shares)} samples ({e})",
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
    return Candidate(p, est, memory_rejection(ctx, p.label, est, devs), subset)
