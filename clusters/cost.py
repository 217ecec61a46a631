"""The cost model: predicted step time and per-device memory of a plan on a cluster.

Compute: seconds per sample per block, from measurement (calibrated or profiled) or from
FLOPs / (peak x ``compute_efficiency``), times the device's emulation slowdown.
Communication: alpha-beta per collective on the group's bottleneck link (``Cluster.path``):
ring all-reduce 2(n-1) alpha + 2(n-1)/n S beta; all-gather / reduce-scatter (n-1) alpha +
(n-1)/n S beta (S = unsharded bytes); point-to-point alpha + S beta.
Pipelines: replica time sum_j t_j + (m-1) max_j t_j (uniform: (m+p-1) t, bubble (p-1)/m);
interleaved with v chunks per rank divides the fill/drain term by v.
Memory: ZeRO accounting (params / grads / optimizer states sharded by stage) plus activations
of the micro-batches in flight (GPipe m, 1F1B at most p - stage). GB = 1e9 bytes throughout,
as in the ZeRO paper. Formulas and their sources: docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import PlanError, ProfileError
from .plan import Plan
from .profile import ModelProfile
from .topology import Cluster, Device, Path

__all__ = [
    "CostModel",
    "Estimate",
    "MemoryBreakdown",
    "collective_time",
    "bubble_fraction",
    "model_state_bytes",
    "stage_blocks",
]


def collective_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of one ring collective of ``nbytes`` (unsharded size) over ``n`` ranks.

    ``kind``: all_reduce, all_gather, reduce_scatter or p2p. ``beta`` is seconds per byte.
    """
    if kind == "p2p":
        return alpha + nbytes * beta if nbytes > 0 else 0.0
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    raise ValueError(f"unknown collective {kind!r}")


def bubble_fraction(
    pp: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """Idle time relative to the ideal m x t: (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * micro_batches)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device: model states (params, grads, optimizer) + activations + buffers."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


def model_state_bytes(
    strategy: str,
    n_params: float,
    n: int,
    *,
    bytes_per_param: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> MemoryBreakdown:
    """Per-device model states under ``strategy`` (dp, zero1, zero2, zero3) over ``n`` ranks.

    ZeRO paper (Rajbhandari et al. 2020), Fig. 1: dp (2+2+K) psi, zero1 2psi + 2psi + K psi/n,
    zero2 2psi + (2+K) psi/n, zero3 (2+2+K) psi/n.
    """
    shard = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}
    if strategy not in shard:
        raise PlanError(f"no model-state rule for {strategy!r}; use dp or zero1..3")
    sp, sg, so = shard[strategy]
    return MemoryBreakdown(
        n_params * bytes_per_param / sp, n_params * grad_bytes / sg, n_params * optimizer_bytes / so
    )


def stage_blocks(plan: Plan) -> list[range]:
    """Block ranges of each (virtual) stage, from ``plan.stage_split``."""
    out, start = [], 0
    for b in plan.stage_split:
        out.append(range(start, start + b))
        start += b
    return out


@dataclass(frozen=True)
class Estimate:
    """Predicted step of a plan. Times in seconds, memory per rank (``memory[rank]``)."""

    step_time: float
    compute: float
    comm: float
    optimizer: float
    bubble: float
    memory: tuple[MemoryBreakdown, ...]
    link: str = ""

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Tunable constants of the model; ``calibrate`` fits them from measurements.

    ``seconds_per_sample``: whole-model forward+backward seconds per sample, by device id
    (figure includes emulation) or device type name (slowdown applied on top).
    ``links``: fitted (alpha s, beta s/byte) by path name, ``"*"`` for every path.
    ``overlap``: fraction of backward compute (2/3 of compute) that hides data-parallel
    communication (0 = none, the conservative default).
    ``pass_overhead_s``: fixed seconds per block per forward+backward pass (kernel launches,
    Python), paid once per micro-batch: what makes very small micro-batches a bad deal.
    """

    compute_efficiency: float = 0.4
    link_efficiency: float = 0.8
    seconds_per_sample: Mapping[str, float] = field(default_factory=dict)
    links: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    step_overhead: float = 0.0
    overlap: float = 0.0
    usable_memory_fraction: float = 0.9
    pass_overhead_s: float = 5e-5

    # ---------------------------------------------------------------- parts
    def alpha_beta(self, path: Path | None) -> tuple[float, float]:
        if path is None:
            return 0.0, 0.0
        fit = self.links.get(path.name) or self.links.get("*")
        if fit is not None:
            return fit
        return path.latency, 1.0 / (path.bandwidth * self.link_efficiency)

    def sample_time(
        self, device: Device, profile: ModelProfile, blocks: Sequence[int] | None = None
    ) -> float:
        """Forward+backward seconds per sample of ``blocks`` (default all) on ``device``.

        Raises ``ProfileError`` when neither a measurement nor FLOPs can time the device.
        """
        idx = range(profile.n_blocks) if blocks is None else blocks
        if device.id in self.seconds_per_sample:
            return self.seconds_per_sample[device.id] * _work_fraction(profile, idx)
        if device.id in profile.block_seconds:
            return sum(profile.block_seconds[device.id][i] for i in idx)
        tname = device.type.name
        if tname in self.seconds_per_sample:
            return self.seconds_per_sample[tname] * _work_fraction(profile, idx) * device.slowdown
        if tname in profile.block_seconds:
            return sum(profile.block_seconds[tname][i] for i in idx) * device.slowdown
        if profile.block_flops is not None:
            rate = device.type.peak_flops(profile.precision) * self.compute_efficiency
            return sum(profile.block_flops[i] for i in idx) / rate * device.slowdown
        raise ProfileError(
            f"cannot time {device.label} ({device.id}): the profile has no block_flops and no "
            "measured seconds for it; pass block_flops or calibrate from measurements"
        )

    def optimizer_time(self, device: Device, n_params: float, profile: ModelProfile) -> float:
        """Memory-bound optimizer update: read+write states, weights and grads once."""
        touched = (
            2
            * n_params
            * (profile.optimizer_bytes_per_param + profile.bytes_per_param + profile.grad_bytes)
        )
        return touched / (device.type.memory_bandwidth_gbps * 1e9) * device.slowdown

    def device_key(self, device: Device, profile: ModelProfile) -> object:
        """Devices with equal keys have equal ``sample_time`` (used to memoize big clusters)."""
        i = device.id
        if (self.seconds_per_sample and i in self.seconds_per_sample) or (
            profile.block_seconds and i in profile.block_seconds
        ):
            return i
        return device.speed_key

    def usable_bytes(self, device: Device) -> float:
        return device.memory_bytes * self.usable_memory_fraction

    # ---------------------------------------------------------------- whole plan
    def estimate(self, plan: Plan, cluster: Cluster, profile: ModelProfile) -> Estimate:
        """Predict ``plan`` (with ``plan.devices`` set) on ``cluster``. Raises ``PlanError``."""
        plan.validate(profile.n_blocks if plan.is_pipeline else None)
        if len(plan.devices) != plan.world_size:
            raise PlanError(f"plan {plan.label!r} names no devices; set Plan.devices")
        devs = [cluster.device(i) for i in plan.devices]
        if plan.is_pipeline:
            from ._pipeline_cost import estimate_pipeline

            return estimate_pipeline(self, plan, cluster, profile, devs)
        return self._estimate_data_parallel(plan, cluster, profile, devs)

    def sync_time(
        self,
        mode: str,
        n_params: float,
        group: Sequence[Device],
        cluster: Cluster,
        profile: ModelProfile,
        micro_batches: int = 1,
        units: int = 1,
    ) -> tuple[float, str]:
        """Seconds of gradient/parameter collectives per step for one data-parallel group.
        ``units``: zero3's FSDP units (elastic wraps every block as one): each gathers its
        parameters in forward and again in backward and reduce-scatters its gradient, so
        the latency term counts per unit while the bytes are the same in total."""
        n = len(group)
        path = cluster.path(group)
        a, b = self.alpha_beta(path)
        sg, sp = n_params * profile.grad_bytes, n_params * profile.bytes_per_param
        ar = collective_time("all_reduce", sg, n, a, b)
        ag = collective_time("all_gather", sp, n, a, b)
        rs = collective_time("reduce_scatter", sg, n, a, b)
        per_unit = (max(1, units) - 1) * (n - 1) * a if n > 1 else 0.0  # latency, per extra unit
        t = {
            "dp": ar,
            "zero1": ar + ag,
            "zero2": ag + micro_batches * rs,
            "zero3": micro_batches * (2 * ag + rs + 3 * per_unit),
        }[mode]
        return t, path.name if path else "-"

    def _estimate_data_parallel(
        self, plan: Plan, cluster: Cluster, profile: ModelProfile, devs: list[Device]
    ) -> Estimate:
        n, m, p_all = plan.world_size, plan.micro_batches, profile.n_params
        memo: dict[object, float] = {}
        for d in devs:
            key = self.device_key(d, profile)
            if key not in memo:
                memo[key] = self.sample_time(d, profile)
        passes = m * profile.n_blocks * self.pass_overhead_s
        comp = [
            s * memo[self.device_key(d, profile)] + passes * d.slowdown
            for s, d in zip(plan.shares, devs, strict=True)
        ]
        comm, link = self.sync_time(plan.strategy, p_all, devs, cluster, profile, m,
                                    units=profile.n_blocks)
        exposed = max(0.0, comm - self.overlap * (2 / 3) * max(comp))
        local_params = p_all / n if plan.strategy != "dp" else p_all
        opt = max(
            self.optimizer_time(d, local_params, profile)
            for d in {(d.type.name, d.slowdown): d for d in devs}.values()
        )
        states = model_state_bytes(
            plan.strategy,
            p_all,
            n,
            bytes_per_param=profile.bytes_per_param,
            grad_bytes=profile.grad_bytes,
            optimizer_bytes=profile.optimizer_bytes_per_param,
        )
        act_per_sample = sum(profile.stored(i) for i in range(profile.n_blocks))
        big = max(profile.block_params)
        buf = {
            "zero2": big * profile.grad_bytes,
            "zero3": 2 * big * profile.bytes_per_param + big * profile.grad_bytes,
        }
        mem = tuple(
            MemoryBreakdown(
                states.params,
                states.grads,
                states.optimizer,
                math.ceil(s / m) * act_per_sample,
                buf.get(plan.strategy, 0.0),
            )
            for s in plan.shares
        )
        step = max(comp) + exposed + opt + self.step_overhead
        return Estimate(step, max(comp), exposed, opt, 0.0, mem, link)


def _work_fraction(profile: ModelProfile, idx: Sequence[int]) -> float:
    """Share of the whole model's work in ``idx`` (by FLOPs, else by parameters)."""
    if len(idx) == profile.n_blocks:
        return 1.0
    weights = profile.block_flops if profile.block_flops is not None else profile.block_params
    total = sum(weights)
    return sum(weights[i] for i in idx) / total if total else len(idx) / profile.n_blocks
