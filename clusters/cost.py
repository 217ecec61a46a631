"""The cost model: predicted step time and per-device memory of a plan on a cluster.

``CostModel`` holds the tunable constants and the per-part costs: compute (seconds per sample
per block, from measurement or from FLOPs / (peak x ``compute_efficiency``), times the
device's emulation slowdown), alpha-beta collectives on a group's bottleneck link
(``collectives``), the optimizer's memory-bound update. ``estimate`` predicts a whole plan:
data-parallel plans here, pipelines and hybrids in ``pipeline_cost`` (which states what it
needs from a cost model as a protocol and does not import this module). Memory: ZeRO
accounting plus buffers (``memory.layout_memory``, the one formula) plus the activations of
the micro-batches in flight. GB = 1e9 bytes throughout, as in the ZeRO paper. Formulas and
their sources: docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .collectives import (
    BROADCAST_BURST,
    FALLBACK_KIND,
    CommConfig,
    burst_points,
    collective_time,
    layout_messages,
    messages_time,
    owner_loads,
    sync_points,
)
from .errors import PlanError, ProfileError
from .estimate import Estimate
from .memory import MemoryBreakdown, layout_memory, model_state_bytes
from .pipeline_cost import (
    MeshLayout,
    SharedCores,
    bubble_fraction,
    estimate_pipeline,
    mesh_layout,
    stage_blocks,
)
from .plan import Plan
from .profile import ModelProfile
from .topology import Cluster, Device, Path

__all__ = [
    "block_weights",
    "CommConfig",
    "CostModel",
    "Estimate",
    "MemoryBreakdown",
    "collective_time",
    "bubble_fraction",
    "model_state_bytes",
    "stage_blocks",
]


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Tunable constants of the model; the profiler measures them and ``calibrate`` or
    ``refit`` fits them from measured steps.

    ``seconds_per_sample``: whole-model forward+backward seconds per sample, by device id
    (figure includes emulation) or device type name (slowdown applied on top).
    ``links``: fitted (alpha s, beta s/byte) by path name, ``"*"`` for every path.
    ``collectives``: measured (alpha s per hop, beta s/byte) by collective kind (all_reduce,
    reduce, broadcast, all_gather, reduce_scatter, p2p, broadcast_burst: one message of a
    burst) on the live group; a kind found here wins over ``links`` and the catalog, and
    stands in for a kind that falls back to it (``collectives.FALLBACK_KIND``).
    ``optimizer_fit``: measured optimizer step, by device id or type name: (seconds per
    tensor, seconds per element, seconds per tensor when sharded as zero3's DTensors); without
    it the update is charged as memory-bound.
    ``overlap``: fraction of backward compute (2/3 of compute) that hides data-parallel
    communication (0 = none, the conservative default); not zero1's and zero2's broadcasts,
    which go after the update (``sync_over``).
    ``pass_overhead_s``: fixed seconds per block per forward+backward pass (kernel launches,
    Python), paid once per micro-batch: what makes very small micro-batches a bad deal.
    ``pass_scale``: a factor on it by device id (the closed loop's re-fit: a device that
    runs k times slower than profiled is so in its fixed costs too, ``clusters.refit``).
    ``step_overhead``: fixed seconds per step beyond its terms (the step loop, the control
    all-reduce, waiting for the slowest rank's jitter); measured by the profiler's trial steps.
    ``sync_wait_s``: what a collective that meets peers right after their compute waits for
    the slowest one, beyond the message itself; paid once per such meeting point
    (``collectives.sync_points``), while ``collectives`` then holds each kind's cost right
    after another message (the profiler measures both; 0: the collectives' figures include
    the wait, charged per message).
    ``burst_wait_s``: the same wait at zero1/zero2's broadcast burst, measured on the burst
    itself, then fitted to the profiler's zero1 trial steps where they ran; None:
    ``sync_wait_s``.
    ``unit_wait_s``: the same wait for each of zero3's per-unit gathers and reduce-scatters
    (FSDP's per-unit hooks run there too), measured by the profiler's zero3 trial steps;
    None: ``sync_wait_s``.
    ``trial_kinds``: the collective kinds the profiler's trial steps sent (dp's; zero3's; the
    burst where zero1's fit met its trial); a real step validated their cost, so the closed
    loop's re-fit leaves them alone.
    ``trial_layouts``: (strategy, device ids) of the profiler's trial steps (dp; zero1 and
    zero3 too where they ran those and their fit met them), each over every live device with
    the profile's shares: a real step met their estimate, so a near tie goes to one of them
    (``planner.break_tie``).
    ``comm``: how the layouts group their messages (``collectives.CommConfig``).
    ``comm_scale``: a factor on each collective kind's time (the closed loop's re-fit,
    ``clusters.refit``: what the running layouts' messages really cost against their
    profiled alpha and beta); 1 for a kind not in it.
    ``pipe_action_s``: seconds each pipeline stage spends per micro-batch beyond its compute
    and p2p messages (the schedule's own work per action; may be negative down to the compute
    alone), ``pipe_bubble_scale``: a factor on the schedule's part that does not grow with
    the micro-batches (the bubble), and ``pipe_msg_scale``: a factor on a pipeline step's
    messages outside the schedule (its batch's all-gathers, the norm's and the commit's
    all-reduces), all fitted to the profiler's pipeline trial steps
    (``clusters.pipeline_fit.fit_pipeline``); 0, 1 and 1 without one. ``pipe_fit_schedule``:
    the schedule those steps ran; another schedule takes a positive ``pipe_action_s`` only.
    ``pipe_fit_reach``: the most micro-batches per stage those steps ran (their largest count
    over their degree; 0 without a fit): the planner offers no pipeline beyond it, where
    the per-micro-batch cost was never measured. ``pipe_step_overhead``: a pipeline step's
    fixed seconds in place of ``step_overhead``, where those steps spent less outside their
    schedule than ``step_overhead`` and the update together (None: ``step_overhead``);
    ``pipe_update_scale``: a factor on a pipeline step's update, where they spent less than
    the update alone (the stages update as their own backward ends, the last stage first,
    while the first still drains: a wide MLP on 3 CPU ranks spent 28-33 ms outside its
    schedule against a 39 ms update on its largest stage). Fitted on a trial of one stage per
    rank without data parallelism, and applied to every pipeline.
    ``shared_cores``: by device id, the CPU ranks that share a crowded host's cores
    (``pipeline_cost.SharedCores``); a pipeline's waiting ranks leave their cores to the busy
    ones. Data-parallel layouts keep every rank busy at once, as the profile did.
    """

    compute_efficiency: float = 0.4
    link_efficiency: float = 0.8
    seconds_per_sample: Mapping[str, float] = field(default_factory=dict)
    links: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    optimizer_fit: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    step_overhead: float = 0.0
    sync_wait_s: float = 0.0
    burst_wait_s: float | None = None
    unit_wait_s: float | None = None
    trial_kinds: tuple[str, ...] = ()
    trial_layouts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    overlap: float = 0.0
    usable_memory_fraction: float = 0.9
    pass_overhead_s: float = 5e-5
    pass_scale: Mapping[str, float] = field(default_factory=dict)
    comm: CommConfig = field(default_factory=CommConfig)
    comm_scale: Mapping[str, float] = field(default_factory=dict)
    shared_cores: Mapping[str, SharedCores] = field(default_factory=dict)
    pipe_action_s: float = 0.0
    pipe_bubble_scale: float = 1.0
    pipe_msg_scale: float = 1.0
    pipe_fit_schedule: str = "1f1b"
    pipe_fit_reach: float = 0.0
    pipe_step_overhead: float | None = None
    pipe_update_scale: float = 1.0

    # ---------------------------------------------------------------- parts
    def alpha_beta(self, path: Path | None, kind: str | None = None) -> tuple[float, float]:
        """(alpha, beta) of ``kind``'s messages on ``path``: measured per kind if known (else
        its ``FALLBACK_KIND``'s: a burst's broadcast as a broadcast alone), else fitted per
        path, else the catalog's link; times ``comm_scale[kind]``."""
        k = self.comm_scale.get(kind, 1.0) if kind is not None else 1.0
        for known in (kind, FALLBACK_KIND.get(kind or "")):
            if known is not None and known in self.collectives:
                a, b = self.collectives[known]
                return a * k, b * k
        if path is None:
            return 0.0, 0.0
        fit = self.links.get(path.name) or self.links.get("*")
        if fit is None:
            fit = (path.latency, 1.0 / (path.bandwidth * self.link_efficiency))
        return fit[0] * k, fit[1] * k

    def sample_time(
        self, device: Device, profile: ModelProfile, blocks: Sequence[int] | None = None
    ) -> float:
        """Forward+backward seconds per sample of ``blocks`` (default all) on ``device``.

        A whole-model figure is split over blocks by the measured per-block times when the
        profile has any, else by FLOPs, else by parameters. Raises ``ProfileError`` when
        neither a measurement nor FLOPs can time the device.
        """
        idx = range(profile.n_blocks) if blocks is None else blocks
        if device.id in self.seconds_per_sample:
            return self.seconds_per_sample[device.id] * _work_fraction(profile, idx, device)
        if device.id in profile.block_seconds:
            return sum(profile.block_seconds[device.id][i] for i in idx)
        tname = device.type.name
        if tname in self.seconds_per_sample:
            return (self.seconds_per_sample[tname] * _work_fraction(profile, idx, device)
                    * device.slowdown)
        if tname in profile.block_seconds:
            return sum(profile.block_seconds[tname][i] for i in idx) * device.slowdown
        if profile.block_flops is not None:
            rate = device.type.peak_flops(profile.precision) * self.compute_efficiency
            flops = profile.block_flops  # (the whole model's summed in C, in the same order)
            work = sum(flops) if blocks is None else sum(flops[i] for i in idx)
            return work / rate * device.slowdown
        raise ProfileError(
            f"cannot time {device.label} ({device.id}): the profile has no block_flops and no "
            "measured seconds for it; pass block_flops or calibrate from measurements"
        )

    def pass_time(self, device: Device) -> float:
        """Fixed seconds per block per pass on ``device`` (``pass_overhead_s``, its
        emulated slowdown and its ``pass_scale``)."""
        return self.pass_overhead_s * device.slowdown * self.pass_scale.get(device.id, 1.0)

    def optimizer_time(self, device: Device, n_params: float, profile: ModelProfile,
                       tensors: int = 0, sharded: bool = False) -> float:
        """One optimizer step over ``n_params`` elements in ``tensors`` tensors on ``device``:
        measured (``optimizer_fit``; ``sharded``: zero3's DTensor shards) or, without a
        measurement, memory-bound (read+write states, weights and grads once)."""
        fit = self.optimizer_fit.get(device.id) or self.optimizer_fit.get(device.type.name)
        if fit is not None:
            per_tensor, per_elem, per_sharded = fit
            return (per_sharded if sharded else per_tensor) * tensors + per_elem * n_params
        touched = (
            2
            * n_params
            * (profile.optimizer_bytes_per_param + profile.bytes_per_param + profile.grad_bytes)
        )
        return touched / (device.type.memory_bandwidth_gbps * 1e9) * device.slowdown

    def layout_optimizer_time(self, mode: str, device: Device, blocks: Sequence[int], n: int,
                              profile: ModelProfile) -> float:
        """The optimizer step of the slowest rank of a group of ``n`` holding ``blocks`` under
        ``mode``: dp every tensor; zero1/zero2 the busiest owner's tensors (ownership as the
        strategies assign it); zero3 every tensor's 1/n shard."""
        tensors = profile.tensors(blocks)
        total = float(sum(tensors))
        if mode == "dp" or n <= 1:
            return self.optimizer_time(device, total, profile, len(tensors))
        if mode == "zero3":
            return self.optimizer_time(device, total / n, profile, len(tensors), sharded=True)
        return max((self.optimizer_time(device, e, profile, t)
                    for t, e in owner_loads(tensors, n)), default=0.0)  # (nothing to
        # update: a stage of parameter-free or frozen blocks)

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
    def estimate(
        self,
        plan: Plan,
        cluster: Cluster,
        profile: ModelProfile,
        *,
        layout: MeshLayout | None = None,
    ) -> Estimate:
        """Predict ``plan`` (with ``plan.devices`` set) on ``cluster``. Raises ``PlanError``.

        ``layout``: for a pipeline, the ``pipeline_cost.mesh_layout`` of ``plan.devices``
        (the planner builds one per device arrangement and reuses it); built here if None.
        """
        known = layout is not None and plan.is_pipeline and layout.matches(plan)
        plan.validate(profile.n_blocks if plan.is_pipeline else None, distinct_devices=not known)
        if len(plan.devices) != plan.world_size:
            raise PlanError(f"plan {plan.label!r} names no devices; set Plan.devices")
        if plan.is_pipeline:
            if layout is None or not known:
                devs = [cluster.device(i) for i in plan.devices]
                layout = mesh_layout(self, cluster, profile, devs, plan.pp_degree)
            return estimate_pipeline(self, plan, profile, layout)
        return self._estimate_data_parallel(plan, cluster, profile,
                                            [cluster.device(i) for i in plan.devices])

    def sync_over(
        self,
        mode: str,
        blocks: Sequence[int],
        n: int,
        path: Path | None,
        profile: ModelProfile,
        micro_batches: int = 1,
        hooks: bool = True,
    ) -> tuple[float, float]:
        """Seconds of ``mode``'s collectives per step for a data-parallel group of ``n`` ranks
        over ``blocks`` whose bottleneck is ``path``: every message the layout sends
        (``collectives.layout_messages``), each at its kind's alpha and beta, and the waits
        where the ranks meet; and of those seconds, what goes after the optimizer's update:
        zero1's and zero2's broadcast burst and its wait, which no backward is left to hide
        (``overlap`` hides the rest). ``hooks``: False for a pipeline stage's reduction after
        its schedule."""
        if n <= 1:
            return 0.0, 0.0
        g, p = profile.grad_bytes, profile.bytes_per_param
        tensors = [t * g for t in profile.tensors(blocks)]
        units = [u * p for u in profile.unit_params(blocks)]
        msgs = layout_messages(mode, n, tensors, units, micro_batches=micro_batches,
                               comm=self.comm, hooks=hooks)
        per = (self.unit_wait_s if mode == "zero3" and self.unit_wait_s is not None
               else self.sync_wait_s)
        points = sync_points(mode, n, len(units), micro_batches, hooks)
        burst = burst_points(mode, n)  # zero1/zero2's broadcasts: the burst's own wait
        at_burst = self.burst_wait_s if self.burst_wait_s is not None else per
        scale = self.comm_scale.get("sync", 1.0)
        ab = {m.kind: self.alpha_beta(path, m.kind) for m in msgs}
        after = scale * at_burst * burst + messages_time(
            [m for m in msgs if m.kind == BROADCAST_BURST], n, ab)
        return scale * per * (points - burst) + after + messages_time(
            [m for m in msgs if m.kind != BROADCAST_BURST], n, ab), after

    def _estimate_data_parallel(
        self, plan: Plan, cluster: Cluster, profile: ModelProfile, devs: list[Device]
    ) -> Estimate:
        n, m, p_all = plan.world_size, plan.micro_batches, profile.n_params
        memo: dict[object, float] = {}
        for d in devs:
            key = self.device_key(d, profile)
            if key not in memo:
                memo[key] = self.sample_time(d, profile)
        passes = m * profile.n_blocks
        comp = [
            s * memo[self.device_key(d, profile)] + passes * self.pass_time(d)
            for s, d in zip(plan.shares, devs, strict=True)
        ]
        path = cluster.path(devs)
        comm, after = self.sync_over(plan.strategy, range(profile.n_blocks), n, path, profile,
                                      m)
        link = path.name if path else "-"
        exposed = max(0.0, comm - after - self.overlap * (2 / 3) * max(comp)) + after
        everything = range(profile.n_blocks)
        opt = max(
            self.layout_optimizer_time(plan.strategy, d, everything, n, profile)
            for d in {(d.id if d.id in self.optimizer_fit else d.type.name, d.slowdown): d
                      for d in devs}.values()
        )
        act_per_sample = sum(profile.stored(i) for i in range(profile.n_blocks))
        by_share = {
            s: layout_memory(
                plan.strategy,
                p_all,
                n,
                bytes_per_param=profile.bytes_per_param,
                grad_bytes=profile.grad_bytes,
                optimizer_bytes=profile.optimizer_bytes_per_param,
                biggest_block=max(profile.block_params),
                units=profile.units,
                biggest_tensor=profile.biggest_tensor(),
                frozen_params=profile.frozen(),
                activations=math.ceil(s / m) * act_per_sample,
            )
            for s in set(plan.shares)
        }
        mem = tuple(by_share[s] for s in plan.shares)
        use, tight = -1.0, 0
        usable: dict[int, float] = {}
        for rank, (s, d) in enumerate(zip(plan.shares, devs, strict=True)):
            if d.memory_bytes not in usable:
                usable[d.memory_bytes] = self.usable_bytes(d)
            ratio = by_share[s].total / usable[d.memory_bytes]
            if ratio > use:
                use, tight = ratio, rank
        step = max(comp) + exposed + opt + self.step_overhead
        return Estimate(step, max(comp), exposed, opt, 0.0, mem, link, use, tight)


def block_weights(profile: ModelProfile, device: Device | None = None) -> Sequence[float]:
    """Each block's share of the work, unnormalized: the per-block times measured on
    ``device`` (its id, else its type, else any measured device's), else FLOPs, else
    parameters (the profile's own sequence: ``sample_time``'s hot path)."""
    bs = profile.block_seconds
    if bs:
        if device is not None and device.id in bs:
            return bs[device.id]
        if device is not None and device.type.name in bs:
            return bs[device.type.name]
        return bs[min(bs)]
    return profile.block_flops if profile.block_flops is not None else profile.block_params


def _work_fraction(profile: ModelProfile, idx: Sequence[int], device: Device | None = None
                   ) -> float:
    """Share of the whole model's work in ``idx`` (``block_weights``)."""
    if len(idx) == profile.n_blocks:
        return 1.0
    weights = block_weights(profile, device)
    total = sum(weights)
    return sum(weights[i] for i in idx) / total if total else len(idx) / profile.n_blocks
