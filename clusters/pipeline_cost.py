"""The pipeline (and pipeline x data-parallel hybrid) part of the cost model.

Virtual stage k (of pp * v) runs on stage position k % pp. Per replica r with micro-batch
b = shares[r] / m, position j takes t_j = sum over its chunks of b x seconds-per-sample of the
chunk's blocks, plus the point-to-point sends of the chunk's boundary activation (forward)
and its gradient (backward). Replica time m max_j t_j + (sum_j t_j - max_j t_j) / v, which is
(m + p - 1) t for equal stages and v = 1. Replicas run in parallel; the step waits for the
slowest, then for the data-parallel sync of each position's parameters (positions in
parallel; contention between them on shared NICs is not modelled).

CPU ranks that share a crowded host's cores (``SharedCores``) were profiled all busy at once,
each on its part of the cores. In a pipeline some of them wait, and the busy ones get more:
the compute is then the larger of the schedule above at the speed a rank has on its own and
each host's total work over its cores (the two bounds of a fluid schedule).

A ``MeshLayout`` groups the replicas of a (pp, dp) device arrangement by everything these
numbers depend on (device speed keys, memory, links), so an estimate costs one computation per
distinct replica, not per rank: on 10,000 alike GPUs a few classes instead of 10,000 rows. The
planner builds one layout per arrangement and passes it to every estimate of it.

This module does not import ``cost``: it states what it needs from a cost model as the
``PartCosts`` protocol, which ``cost.CostModel`` satisfies.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .collectives import collective_time, per_micro_batch
from .errors import PlanError
from .estimate import Estimate
from .memory import MemoryBreakdown, layout_memory
from .plan import Plan
from .profile import ModelProfile
from .topology import Cluster, Device, Path

__all__ = ["PartCosts", "SharedCores", "MeshLayout", "DeviceClasses", "device_classes",
           "mesh_layout", "estimate_pipeline", "bubble_fraction", "stage_blocks"]


@dataclass(frozen=True)
class SharedCores:
    """A CPU rank on a host whose ranks need more threads than it has cores: ``host`` (what
    groups them), its ``cores``, the rank's ``threads`` and ``host_threads``, the threads of
    all the ranks that were profiled there at once. Profiled, the rank ran on
    ``cores x threads / host_threads`` cores; on its own it runs on ``min(threads, cores)``."""

    host: object
    cores: float
    threads: float
    host_threads: float

    @property
    def alone(self) -> float:
        """Its time on its own over its profiled time (below 1)."""
        return min(1.0, self.cores * self.threads / self.host_threads
                   / min(self.threads, self.cores))

    @property
    def weight(self) -> float:
        """Its profiled seconds' share of the host's cores: the host is busy for the sum of
        its ranks' profiled seconds times their weights."""
        return self.threads / self.host_threads


class PartCosts(Protocol):
    """What a pipeline estimate asks of a cost model (``cost.CostModel`` is one)."""

    def pass_time(self, device: Device) -> float: ...

    @property
    def overlap(self) -> float: ...

    @property
    def step_overhead(self) -> float: ...

    @property
    def sync_wait_s(self) -> float: ...

    @property
    def shared_cores(self) -> Mapping[str, SharedCores]: ...

    @property
    def pipe_action_s(self) -> float: ...

    @property
    def pipe_bubble_scale(self) -> float: ...

    @property
    def pipe_msg_scale(self) -> float: ...

    @property
    def pipe_fit_schedule(self) -> str: ...

    @property
    def pipe_step_overhead(self) -> float | None: ...

    @property
    def pipe_update_scale(self) -> float: ...

    def alpha_beta(self, path: Path | None, kind: str | None = None) -> tuple[float, float]: ...

    def sample_time(self, device: Device, profile: ModelProfile,
                    blocks: Sequence[int] | None = None) -> float: ...

    def layout_optimizer_time(self, mode: str, device: Device, blocks: Sequence[int], n: int,
                              profile: ModelProfile) -> float: ...

    def device_key(self, device: Device, profile: ModelProfile) -> object: ...

    def usable_bytes(self, device: Device) -> float: ...

    def sync_over(self, mode: str, blocks: Sequence[int], n: int, path: Path | None,
                  profile: ModelProfile, micro_batches: int = 1, hooks: bool = True
                  ) -> tuple[float, float]: ...


def bubble_fraction(
    pp: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """Idle time relative to the ideal m x t: (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * micro_batches)


def stage_blocks(plan: Plan) -> list[range]:
    """Block ranges of each (virtual) stage, from ``plan.stage_split``."""
    out, start = [], 0
    for b in plan.stage_split:
        out.append(range(start, start + b))
        start += b
    return out


@dataclass
class _Memo:
    """``MeshLayout.memo``: keyed by stage split (and dp_mode, micro-batches where read)."""

    refs: tuple[object, object]  # the model and profile, kept alive so their ids stay theirs
    sample: dict[tuple[object, int, int], float] = field(default_factory=dict)
    replica: dict[tuple[object, ...], tuple[list[float], list[float]]] = field(
        default_factory=dict)
    positions: dict[tuple[int, ...], list[_Position]] = field(default_factory=dict)
    sync: dict[tuple[object, ...], tuple[float, float, str]] = field(default_factory=dict)
    optimizer: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    states: dict[tuple[str, tuple[int, ...]], list[MemoryBreakdown]] = field(
        default_factory=dict)
    usable: dict[tuple[tuple[int, int, int], ...], list[list[float]]] = field(
        default_factory=dict)
    timing: dict[int, tuple[Plan, tuple[float, float, float, float, str]]] = field(
        default_factory=dict)


@dataclass(frozen=True)
class MeshLayout:
    """Devices of a (pp, dp) mesh, rank = stage * dp + replica, with replicas grouped into
    classes that cost the same: equal device keys, memory and optimizer speed per position,
    and equal links from each position to the next (the last to the first, for interleaving).

    ``rows[c]`` is one replica of class ``c`` (a device per position), ``links[c][j]`` the
    point-to-point path from position j to (j + 1) % pp in it, ``group_paths[j]`` the path of
    position j's data-parallel group, ``position_devices[j]`` one device per distinct
    (type, slowdown) at position j (the optimizer's speed)."""

    pp: int
    dp: int
    ids: tuple[str, ...]
    devices: tuple[Device, ...]
    replica_class: tuple[int, ...]
    rows: tuple[tuple[Device, ...], ...]
    links: tuple[tuple[Path, ...], ...]
    group_paths: tuple[Path | None, ...]
    position_devices: tuple[tuple[Device, ...], ...]
    _kinds: dict[tuple[int, ...], tuple[tuple[tuple[int, int, int], ...],
                                        tuple[tuple[int, int], ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _memo: dict[tuple[int, int], _Memo] = field(default_factory=dict, init=False,
                                                repr=False, compare=False)

    def matches(self, plan: Plan) -> bool:
        return self.pp == plan.pp_degree and (self.ids is plan.devices or self.ids == plan.devices)

    def memo(self, model: object, profile: object) -> _Memo:
        """Figures of this layout under ``model`` and ``profile`` that the planner's tries
        (each m, schedule and dp_mode on it) share; one memo, replaced under others."""
        key = (id(model), id(profile))
        hit = self._memo.get(key)
        if hit is None or hit.refs[0] is not model or hit.refs[1] is not profile:
            self._memo.clear()
            hit = self._memo[key] = _Memo((model, profile))
        return hit

    def share_kinds(self, shares: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
        """Each distinct (replica class, share) under ``shares`` with its first replica, as
        (class, share, replica) in replica order."""
        return self._shares(shares)[0]

    def share_runs(self, shares: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``shares`` as (share, how many in a row) runs."""
        return self._shares(shares)[1]

    def _shares(self, shares: tuple[int, ...]) -> tuple[tuple[tuple[int, int, int], ...],
                                                         tuple[tuple[int, int], ...]]:
        """O(dp) once per shares (the planner tries each on several schedules and dp
        modes), then a lookup."""
        hit = self._kinds.get(shares)
        if hit is None:
            pairs = list(zip(self.replica_class, shares, strict=True))
            # earlier duplicates overwrite later ones when built from the reversed pairs
            first = dict(zip(reversed(pairs), range(self.dp - 1, -1, -1), strict=True))
            kinds = tuple((c, s, r) for (c, s), r in sorted(first.items(), key=lambda kv: kv[1]))
            runs = tuple((s, len(list(g))) for s, g in itertools.groupby(shares))
            hit = self._kinds[shares] = (kinds, runs)
        return hit


@dataclass(frozen=True)
class DeviceClasses:
    """Per device id: ``cls``, equal for devices whose pipeline costs are equal (speed key,
    memory, optimizer speed, their node's links), and ``node``, its node's id."""

    cls: Mapping[str, int]
    node: Mapping[str, str]


def device_classes(
    model: PartCosts, profile: ModelProfile, devices: Sequence[Device]
) -> DeviceClasses:
    """``DeviceClasses`` of ``devices``: O(devices), once per planning call."""
    index: dict[object, int] = {}
    cls: dict[str, int] = {}
    node: dict[str, str] = {}
    for d in devices:
        key = (model.device_key(d, profile), d.type.name, d.slowdown, d.memory_bytes, d.pool,
               model.shared_cores.get(d.id))
        cls[d.id] = index.setdefault(key, len(index))
        node[d.id] = d.node
    return DeviceClasses(cls, node)


def mesh_layout(
    model: PartCosts,
    cluster: Cluster,
    profile: ModelProfile,
    devices: Sequence[Device],
    pp: int,
    classes: DeviceClasses | None = None,
) -> MeshLayout:
    """The layout of ``devices`` (one per rank, rank = stage * dp + replica) as ``pp`` stages.
    ``classes``: ``device_classes`` of (a superset of) ``devices``, computed here if None.
    O(ranks) with C-level passes; every estimate on the layout is then O(replicas) or less.

    Point-to-point links are assumed alike for nodes of one pool (as cluster files and the
    inventory build them): a replica's class records its devices' classes and which
    consecutive positions share a node, and one representative's links stand for the class.
    """
    dp = len(devices) // pp
    devs = tuple(devices)
    ids = tuple(map(operator.attrgetter("id"), devs))
    if len(set(ids)) != len(ids) or dp * pp != len(ids):
        raise PlanError(f"a pp={pp} layout needs distinct devices, a multiple of {pp} of them")
    classes = classes or device_classes(model, profile, devs)
    cls = list(map(classes.cls.__getitem__, ids))
    nodes = list(map(classes.node.__getitem__, ids))
    node_rows = [nodes[j * dp:(j + 1) * dp] for j in range(pp)]
    same = [list(map(operator.eq, node_rows[j], node_rows[(j + 1) % pp])) for j in range(pp)]
    sigs = zip(zip(*(cls[j * dp:(j + 1) * dp] for j in range(pp)), strict=True),
               zip(*same, strict=True), strict=True)
    index: dict[object, int] = {}
    replica_class = [index.setdefault(sig, len(index)) for sig in sigs]
    # class -> its first replica (earlier replicas overwrite later ones when built reversed)
    first = dict(zip(reversed(replica_class), range(dp - 1, -1, -1), strict=True))
    rows = tuple(devs[first[c]::dp] for c in range(len(index)))
    links = tuple(tuple(cluster.p2p_path(row[j], row[(j + 1) % pp]) for j in range(pp))
                  for row in rows)
    rep = dict(zip(cls, devs, strict=True))  # a device of each class
    by_position = [sorted(set(cls[j * dp:(j + 1) * dp])) for j in range(pp)]
    return MeshLayout(
        pp=pp,
        dp=dp,
        ids=ids,
        devices=devs,
        replica_class=tuple(replica_class),
        rows=rows,
        links=links,
        group_paths=tuple(cluster.path_over(Counter(r)) if dp > 1 else None
                          for r in node_rows),
        position_devices=tuple(
            tuple({(rep[c].type.name, rep[c].slowdown): rep[c] for c in cs}.values())
            for cs in by_position),
    )


def _in_flight(schedule: str, m: int, p: int, v: int, j: int) -> float:
    """Micro-batches (in units of a whole position's activations) stage position j holds."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - j))
    # Interleaved 1F1B (Narayanan et al. 2021, Megatron's warm-up count), in chunks of 1/v.
    return min(m * v, 2 * (p - j - 1) + (v - 1) * p + 1) / v


def _step_messages(model: PartCosts, plan: Plan, layout: MeshLayout) -> float:
    """What every pipeline step sends beyond its activations and its dp sync
    (``strategies.pipeline``): the replica's batch and targets all-gathered over the
    pipeline group, the global gradient norm's and the commit's one-element all-reduces over
    the world. Two of them meet ranks right after compute (the batch's, after the previous
    step; the norm's, after the schedule): a wait each; the others follow at their idle
    cost. The batch's bytes are not in the profile: charged as latency."""
    p, world = plan.pp_degree, plan.world_size
    if world <= 1:
        return 0.0
    row_links = layout.links[0] if layout.links else ()
    pp_path = row_links[0] if row_links else None
    world_path = (layout.group_paths[0] if layout.group_paths else None) or pp_path
    ag = model.alpha_beta(pp_path, "all_gather")
    ar = model.alpha_beta(world_path, "all_reduce")
    t = 2 * collective_time("all_gather", 8.0, p, *ag) if p > 1 else 0.0
    t += 2 * collective_time("all_reduce", 8.0, world, *ar)
    return (t + 2 * model.sync_wait_s) * model.pipe_msg_scale


@dataclass(frozen=True)
class _Position:
    """What a pipeline position holds under one stage split: its blocks (every chunk's),
    their parameters, its biggest block, FSDP units, biggest tensor, frozen parameters and
    stored activations per sample."""

    blocks: tuple[int, ...]
    params: int
    biggest_block: int
    units: int
    biggest_tensor: int
    frozen: int
    stored: float


def _positions(profile: ModelProfile, stages: list[range],
               chunks: list[list[int]]) -> list[_Position]:
    out = []
    for chunk in chunks:
        blocks = tuple(i for k in chunk for i in stages[k])
        out.append(_Position(
            blocks=blocks,
            params=sum(profile.block_params[i] for i in blocks),
            biggest_block=max(profile.block_params[i] for i in blocks),
            units=len(profile.unit_params(blocks)),
            biggest_tensor=profile.biggest_tensor(blocks),
            frozen=profile.frozen(blocks),
            stored=sum(profile.stored(i) for i in blocks),
        ))
    return out


def _sync(model: PartCosts, profile: ModelProfile, layout: MeshLayout, mode: str,
          pos: list[_Position], m: int) -> tuple[float, float, str]:
    """The slowest position's data-parallel reduction after the schedule: its seconds, of
    them what follows the optimizer's update, and its link's name."""
    comm, after, link = 0.0, 0.0, "-"
    if layout.dp > 1:
        for at, path in zip(pos, layout.group_paths, strict=True):
            t_sync, t_after = model.sync_over(mode, at.blocks, layout.dp, path, profile, m,
                                              hooks=False)
            if t_sync >= comm:
                comm, after, link = t_sync, t_after, path.name if path else "-"
    return comm, after, link


def _replica_times(
    model: PartCosts, profile: ModelProfile, layout: MeshLayout, stages: list[range],
    chunks: list[list[int]], b: int, c: int, clamp: bool,
    memo: dict[tuple[object, int, int], float],
) -> tuple[list[float], list[float]]:
    """Per position of a replica of class ``c`` running micro-batches of ``b`` samples: its
    time per micro-batch with its messages, and its compute alone."""
    p, n_st = layout.pp, len(stages)
    row, links = layout.rows[c], layout.links[c]
    t, work = [], []
    for j in range(p):
        key = model.device_key(row[j], profile)
        tj = 0.0
        for k in chunks[j]:
            at = (key, stages[k].start, stages[k].stop)
            if at not in memo:
                memo[at] = model.sample_time(row[j], profile, stages[k])
            tj += b * memo[at]
            tj += len(stages[k]) * model.pass_time(row[j])
        # the schedule's own work per action: the host's too; below 0, what the messages
        # cost less than their profiled figure, never a stage below its compute, and only
        # for the schedule the trial ran (1F1B, one chunk per rank; ``clamp`` False): an
        # interleaved schedule made cheaper by it was picked at 1.29-1.35x dp on 2 CPU ranks
        # (mlp, dlrm), and GPipe's schedule measured 8-51 % above 1F1B's there
        act = len(chunks[j]) * model.pipe_action_s
        if clamp:
            act = max(0.0, act)
        work.append(tj + max(0.0, act))
        for k in chunks[j]:
            if k < n_st - 1:
                a, beta = model.alpha_beta(links[k % p], "p2p")
                nbytes = b * profile.boundary(stages[k][-1])
                tj += 2 * collective_time("p2p", nbytes, 2, a, beta)
        t.append(max(tj + act, work[-1]))
    return t, work


def pipeline_step_time(
    model: PartCosts, plan: Plan, profile: ModelProfile, layout: MeshLayout
) -> float:
    """``estimate_pipeline(...).step_time`` without the memory: what the planner orders the
    tries that fit by (``pipeline_memory_use`` first)."""
    return _timing(model, plan, profile, layout)[0]


def _stages(plan: Plan) -> tuple[list[range], list[list[int]]]:
    """``plan``'s stages' blocks and each position's stages (its chunks)."""
    p, stages = plan.pp_degree, stage_blocks(plan)
    return stages, [[k for k in range(len(stages)) if k % p == j] for j in range(p)]


def _timing(
    model: PartCosts, plan: Plan, profile: ModelProfile, layout: MeshLayout
) -> tuple[float, float, float, float, str]:
    """The step time of ``plan`` on ``layout`` and its parts: compute, exposed
    communication, the optimizer's update, and the reduction's link."""
    memo = layout.memo(model, profile)
    hit = memo.timing.get(id(plan))
    if hit is not None and hit[0] is plan:  # pipeline_step_time's, before the estimate
        return hit[1]
    p, dp, m, v = plan.pp_degree, plan.dp_degree, plan.micro_batches, plan.virtual_stages
    stages, chunks = _stages(plan)

    # One replica time per distinct (micro-batch size, class): replicas run in parallel.
    # ``times``: each position's compute alone (no messages), the work a crowded host shares.
    # the schedule's own work per action counts below 0 (what the messages cost less than
    # their profiled figure) only for the schedule the trial ran: see ``_replica_times``
    clamp = v > 1 or plan.schedule != model.pipe_fit_schedule
    compute = 0.0
    shared = model.shared_cores
    times: dict[tuple[int, int], list[float]] = {}
    kinds = layout.share_kinds(plan.shares)
    for b, c in {(s // m, c) for c, s, _ in kinds}:
        row = layout.rows[c]
        key = (c, b, plan.stage_split, clamp)
        if key not in memo.replica:
            memo.replica[key] = _replica_times(model, profile, layout, stages, chunks, b, c,
                                               clamp, memo.sample)
        t, work = memo.replica[key]
        times[b, c] = work
        if shared:  # on its own a rank of a crowded host is faster than profiled
            t = [tj * (shared[d.id].alone if d.id in shared else 1.0)
                 for tj, d in zip(t, row, strict=True)]
        tmax = max(t)
        compute = max(compute, m * tmax + model.pipe_bubble_scale * (sum(t) - tmax) / v)
    if shared:
        busy: dict[object, float] = {}
        for r, (s, c) in enumerate(zip(plan.shares, layout.replica_class, strict=True)):
            for j in range(p):
                sc = shared.get(layout.devices[j * dp + r].id)
                if sc is not None:
                    busy[sc.host] = busy.get(sc.host, 0.0) + m * times[s // m, c][j] * sc.weight
        compute = max(compute, *busy.values()) if busy else compute

    pos = memo.positions.get(plan.stage_split)
    if pos is None:
        pos = memo.positions[plan.stage_split] = _positions(profile, stages, chunks)
    mode = plan.dp_mode
    # a stage reduces once after its schedule; only what grows per micro-batch reads m
    sync_key = (mode, plan.stage_split, m if per_micro_batch(mode, hooks=False) else 1)
    if sync_key not in memo.sync:
        memo.sync[sync_key] = _sync(model, profile, layout, mode, pos, m)
    comm, after, link = memo.sync[sync_key]
    exposed = max(0.0, comm - after - model.overlap * (2 / 3) * compute) + after

    opt_key = (mode, plan.stage_split)
    if opt_key not in memo.optimizer:
        memo.optimizer[opt_key] = max([0.0] + [
            model.layout_optimizer_time(mode, d, at.blocks, dp, profile)
            for at, devs in zip(pos, layout.position_devices, strict=True) for d in devs])
    opt = memo.optimizer[opt_key]

    opt *= model.pipe_update_scale
    fixed = model.step_overhead if model.pipe_step_overhead is None else model.pipe_step_overhead
    step = compute + exposed + opt + fixed + _step_messages(model, plan, layout)
    memo.timing[id(plan)] = (plan, (step, compute, exposed, opt, link))  # plan kept: its id
    return step, compute, exposed, opt, link


def pipeline_memory_use(
    model: PartCosts, plan: Plan, profile: ModelProfile, layout: MeshLayout
) -> tuple[float, int, MemoryBreakdown]:
    """``estimate_pipeline``'s ``memory_use`` and ``tightest_rank``, and that rank's memory,
    without every rank's: what the planner rejects a try by."""
    use, tight, at_share, _ = _memory(model, plan, profile, layout, every_rank=False)
    return use, tight, at_share(tight // layout.dp, plan.shares[tight % layout.dp])


def _memory(
    model: PartCosts, plan: Plan, profile: ModelProfile, layout: MeshLayout, every_rank: bool
) -> tuple[float, int, Callable[[int, int], MemoryBreakdown], tuple[MemoryBreakdown, ...]]:
    """The largest share of usable memory any rank needs and the first rank (stage-major)
    needing it, a position's memory at a share (position, share -> breakdown), and
    (``every_rank``) every rank's. Each (position, share)'s total is summed as
    ``MemoryBreakdown.total`` sums it, without building one (thousands of tries a call)."""
    p, dp, m, v = plan.pp_degree, plan.dp_degree, plan.micro_batches, plan.virtual_stages
    memo = layout.memo(model, profile)
    pos = memo.positions.get(plan.stage_split)
    if pos is None:
        pos = memo.positions[plan.stage_split] = _positions(profile, *_stages(plan))
    kinds = layout.share_kinds(plan.shares)
    mode = plan.dp_mode
    states = memo.states.get((mode, plan.stage_split))
    if states is None:  # model states and buffers per position, without activations
        states = memo.states[mode, plan.stage_split] = [layout_memory(
            mode,
            at.params,
            dp,
            bytes_per_param=profile.bytes_per_param,
            grad_bytes=profile.grad_bytes,
            optimizer_bytes=profile.optimizer_bytes_per_param,
            biggest_block=at.biggest_block,
            units=at.units,
            biggest_tensor=at.biggest_tensor,
            frozen_params=at.frozen,
        ) for at in pos]
    sizes = sorted({s for _, s, _ in kinds})
    mem: list[MemoryBreakdown] = []
    use, tight = -1.0, 0
    usable = memo.usable.get(kinds)
    if usable is None:  # per position, each kind's first replica's usable bytes
        usable = memo.usable[kinds] = [
            [model.usable_bytes(layout.rows[c][j]) for c, _, _ in kinds] for j in range(p)]
    held = [_in_flight(plan.schedule, m, p, v, j) for j in range(p)]

    def at_share(j: int, s: int) -> MemoryBreakdown:
        st = states[j]
        return MemoryBreakdown(st.params, st.grads, st.optimizer,
                               held[j] * (s // m) * pos[j].stored, st.buffers)

    for j, (at, st) in enumerate(zip(pos, states, strict=True)):
        if every_rank:
            by_share = {s: at_share(j, s) for s in sizes}
            for s, n in layout.share_runs(plan.shares):
                mem.extend([by_share[s]] * n)
        # the first rank (stage-major) of each distinct (class, share)
        states_b, buf, h, stored = st.model_states, st.buffers, held[j], at.stored
        totals = {s: states_b + h * (s // m) * stored + buf for s in sizes}
        for (_, s, r), cap in zip(kinds, usable[j], strict=True):
            ratio = totals[s] / cap
            if ratio > use:
                use, tight = ratio, j * dp + r
    return use, tight, at_share, tuple(mem)


def estimate_pipeline(
    model: PartCosts, plan: Plan, profile: ModelProfile, layout: MeshLayout
) -> Estimate:
    """Predict the pipeline ``plan`` laid out as ``layout`` (which must match its devices)."""
    p, m, v = plan.pp_degree, plan.micro_batches, plan.virtual_stages
    step, compute, exposed, opt, link = _timing(model, plan, profile, layout)
    layout.memo(model, profile).timing.pop(id(plan), None)  # (estimated: not asked again)
    use, tight, _, mem = _memory(model, plan, profile, layout, every_rank=True)
    return Estimate(step, compute, exposed, opt, bubble_fraction(p, m, plan.schedule, v),
                    mem, link, use, tight)
