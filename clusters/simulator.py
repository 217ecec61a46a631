"""Simulator: a long job on a large cluster under node failures, per failure policy.

Event-driven: node failures (a given trace, or exponential times per node from each pool's
MTBF, the node coming back ``repair_s`` later) and the job's own events (checkpoint commits,
recovery done). Between events the job runs at the step time the cost model and planner
predict for the nodes alive (cached per pool composition), so shrinking and growing change
speed as they would live. Two policies, as decisions (they do not run anything):

* ``RestartAll`` (Ray Train / torchrun style): any membership change restarts the whole group
  from the last committed checkpoint: steps since it are lost, plus detection + restart.
* ``ElasticInPlace`` (this project): survivors keep their processes; detection + re-plan +
  restore from peers when every lost shard has a live replica (dp, or pipeline stages with
  dp replicas), otherwise from the last checkpoint; a returning node joins at a step
  boundary after a short pause, losing nothing.

Goodput = steps kept / steps an always-healthy full cluster would run in the same time.
The same failure trace is replayed for every policy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .plan import Plan
from .profile import ModelProfile
from .topology import Cluster

__all__ = [
    "FailureEvent",
    "SimConfig",
    "RestartAll",
    "ElasticInPlace",
    "Recovery",
    "PolicyResult",
    "failure_trace",
    "simulate",
    "format_sim_table",
]

Evaluator = Callable[[Cluster], "tuple[float, Plan | None]"]


@dataclass(frozen=True)
class FailureEvent:
    """Node ``node`` fails at ``time`` s and is back ``repair_s`` later (None: config's)."""

    time: float
    node: str
    repair_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Job and environment. ``node_mtbf_s`` by pool name (key ``"*"`` for all pools).

    The default MTBF, ~260 days per 8-GPU node, is the order of magnitude of published large
    runs (Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs).
    """

    duration_s: float = 7 * 86400.0
    checkpoint_every: int = 500
    checkpoint_stall_s: float = 0.0
    upload_s: float | None = None  # default: state bytes / storage_bandwidth
    restore_s: float | None = None  # default: state bytes / storage_bandwidth
    peer_restore_s: float | None = None  # default: one node's share of the state over its NICs
    storage_bandwidth: float = 5e9  # bytes/s, all workers together, object storage
    repair_s: float = 3600.0
    node_mtbf_s: Mapping[str, float] = field(default_factory=lambda: {"*": 260 * 86400.0})
    seed: int = 0


@dataclass(frozen=True)
class Recovery:
    """A policy's decision: stop for ``downtime_s``, and roll back to the checkpoint or not."""

    downtime_s: float
    rollback: bool


@dataclass(frozen=True, kw_only=True)
class RestartAll:
    """Restart everything from the last checkpoint on every membership change.

    Detection ~15 s: a dead node shows in ``ray.nodes()`` after 13.6-14.9 s by default
    (docs/../notes measured here); restart: group re-creation and start-up (Ray Train measured
    ~9-15 s on a toy job; minutes at scale) - restore time is added separately.
    """

    name: str = "restart-all"
    detection_s: float = 15.0
    restart_s: float = 120.0

    def on_failure(self, replicas_survive: bool, restore_s: float, peer_s: float) -> Recovery:
        return Recovery(self.detection_s + self.restart_s + restore_s, True)

    def on_join(self, restore_s: float) -> Recovery:
        return Recovery(self.restart_s + restore_s, True)


@dataclass(frozen=True, kw_only=True)
class ElasticInPlace:
    """Survivors keep state; re-plan and restore from peers; joins at a step boundary.

    Detection ~1 s: survivors blocked in a collective error out 0.2-1 s after a node dies.
    """

    name: str = "elastic"
    detection_s: float = 1.0
    replan_s: float = 10.0
    grow_s: float = 10.0

    def on_failure(self, replicas_survive: bool, restore_s: float, peer_s: float) -> Recovery:
        if replicas_survive:
            return Recovery(self.detection_s + self.replan_s + peer_s, False)
        return Recovery(self.detection_s + self.replan_s + restore_s, True)

    def on_join(self, restore_s: float) -> Recovery:
        return Recovery(self.grow_s, False)


@dataclass(frozen=True)
class PolicyResult:
    """Outcome of one policy. Times in seconds; ``goodput`` in [0, 1]."""

    policy: str
    duration_s: float
    steps: float
    ideal_steps: float
    failures: int
    rollbacks: int
    lost_steps: float
    downtime_s: float
    recompute_s: float
    degraded_s: float
    checkpoint_s: float

    @property
    def goodput(self) -> float:
        return self.steps / self.ideal_steps if self.ideal_steps else 0.0

    @property
    def time_lost_s(self) -> float:
        """Wall time not turned into kept full-speed steps."""
        return self.downtime_s + self.recompute_s + self.degraded_s + self.checkpoint_s


def failure_trace(cluster: Cluster, config: SimConfig) -> list[FailureEvent]:
    """Failures over ``config.duration_s``: per node, exponential gaps from its pool's MTBF,
    counted from the node's return. Deterministic for a given ``config.seed``."""
    rng = random.Random(config.seed)
    out = []
    for node in cluster.nodes:
        mtbf = config.node_mtbf_s.get(node.pool, config.node_mtbf_s.get("*"))
        if not mtbf:
            continue
        t = rng.expovariate(1.0 / mtbf)
        while t < config.duration_s:
            out.append(FailureEvent(t, node.id))
            t += config.repair_s + rng.expovariate(1.0 / mtbf)
    return sorted(out, key=lambda e: (e.time, e.node))


def _replicas_survive(plan: Plan | None, cluster: Cluster, dead_node: str) -> bool:
    """Does every rank on ``dead_node`` have a same-state peer on another node?"""
    if plan is None:
        return True
    if plan.strategy in ("zero1", "zero2", "zero3") or (
        plan.is_pipeline and (plan.dp_mode != "dp" or plan.dp_degree < 2)
    ):
        return False
    node_of = [cluster.device(i).node for i in plan.devices]
    for rank, nd in enumerate(node_of):
        if nd != dead_node:
            continue
        if plan.is_pipeline:
            stage = plan.coords(rank)[0]
            peers = [plan.rank(stage, r) for r in range(plan.dp_degree)]
        else:
            peers = list(range(plan.world_size))
        if all(node_of[p] == dead_node for p in peers):
            return False
    return True


def _remap(plan: Plan | None, seen: Cluster, alive: Cluster) -> Plan | None:
    """The cached plan of an equal pool composition, moved onto ``alive``'s devices.

    Pools are homogeneous, so the i-th device of a pool in ``seen`` maps to the i-th of the
    same pool in ``alive`` (same node pattern, since nodes of a pool are alike).
    """
    if plan is None or seen is alive:
        return plan
    mapping: dict[str, str] = {}
    for pool in seen.pools:
        old = [d.id for d in seen.devices if d.pool == pool.name]
        new = [d.id for d in alive.devices if d.pool == pool.name]
        mapping.update(zip(old, new, strict=True))
    return replace(plan, devices=tuple(mapping[i] for i in plan.devices))


def simulate(
    cluster: Cluster,
    profile: ModelProfile,
    global_batch: int,
    *,
    policies: Sequence[RestartAll | ElasticInPlace] = (RestartAll(), ElasticInPlace()),
    config: SimConfig | None = None,
    trace: Sequence[FailureEvent] | None = None,
    evaluate: Evaluator | None = None,
    **plan_kwargs: object,
) -> list[PolicyResult]:
    """Run every policy over the same failure trace; one ``PolicyResult`` each.

    ``evaluate(alive_cluster) -> (step_time, plan)`` replaces the planner (tests inject a
    closed form); by default ``planner.plan(alive, profile, global_batch, **plan_kwargs)``.
    """
    from ._sim_run import run_policy

    config = config or SimConfig()
    events = list(trace) if trace is not None else failure_trace(cluster, config)
    cache: dict[tuple[tuple[str, int], ...], tuple[float, Plan | None, Cluster]] = {}

    def step_of(alive: Cluster) -> tuple[float, Plan | None]:
        key = tuple((p.name, p.count) for p in alive.pools)
        if key not in cache:
            if evaluate is not None:
                st, pl = evaluate(alive)
            else:
                from .planner import plan

                res = plan(alive, profile, global_batch, **plan_kwargs)  # type: ignore[arg-type]
                ch = res.choice
                st, pl = (
                    (ch.estimate.step_time, ch.plan) if ch and ch.estimate else (math.inf, None)
                )
            cache[key] = (st, pl, alive)
        st, pl, seen = cache[key]
        return st, _remap(pl, seen, alive)

    state_bytes = profile.n_params * (profile.bytes_per_param + profile.optimizer_bytes_per_param)
    return [
        run_policy(pol, cluster, events, config, step_of, state_bytes, _replicas_survive)
        for pol in policies
    ]


def format_sim_table(results: Sequence[PolicyResult]) -> str:
    """One row per policy: goodput, steps, failures, and where the time went (hours)."""
    hdr = (
        f"{'policy':<14}{'goodput':>8}{'steps':>11}{'failures':>9}{'rollbacks':>10}"
        f"{'lost steps':>11}{'down h':>8}{'redo h':>8}{'slow h':>8}{'ckpt h':>8}"
    )
    rows = [hdr, "-" * len(hdr)]
    for r in results:
        rows.append(
            f"{r.policy:<14}{r.goodput:>8.1%}{r.steps:>11.0f}{r.failures:>9}"
            f"{r.rollbacks:>10}{r.lost_steps:>11.0f}{r.downtime_s / 3600:>8.2f}"
            f"{r.recompute_s / 3600:>8.2f}{r.degraded_s / 3600:>8.2f}"
            f"{r.checkpoint_s / 3600:>8.2f}"
        )
    return "\n".join(rows)
