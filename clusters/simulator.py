"""Simulator: a long job on a large cluster under failures, per failure policy.

``simulate`` replays one failure trace (given, or generated from ``SimConfig``'s MTBFs; see
``trace``) for every policy. Between events the job runs at the step time the planner
predicts for the nodes alive (``sim_plans``: cached per pool composition), so shrinking and
growing change speed as they would live. The policies are the live ones
(``clusters.policy``) with a table of time costs (``sim_policies``: ``RestartAll`` as Ray
Train and torchrun run, ``ElasticInPlace`` as this project does); the loop is in
``sim_loop``.

Goodput = steps kept / steps an always-healthy whole cluster would run in the same time.
Cost = what the nodes held cost at their pools' prices per device-hour (``NodePool.device_price``:
the cluster file's, else the catalog's for the pool's market), so spot and on-demand pools,
preemptions with their notices (``trace.preemption_trace``) and the systems that act on them
(``sim_policies``) compare on goodput and on cost per 1,000 steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import PlanError
from .plan import Plan
from .profile import ModelProfile
from .sim_config import PolicyResult, SimConfig, format_sim_table
from .sim_loop import SimSetup, run_policy
from .sim_plans import Evaluator, PlanCache
from .sim_policies import (
    ElasticInPlace,
    Recovery,
    RestartAll,
    RestoreTimes,
    SimPolicy,
    TimeCosts,
)
from .topology import Cluster
from .trace import FailureEvent, failure_trace, validate_trace

__all__ = [
    "FailureEvent",
    "SimConfig",
    "SimPolicy",
    "TimeCosts",
    "RestartAll",
    "ElasticInPlace",
    "Recovery",
    "PolicyResult",
    "failure_trace",
    "plan_cache",
    "simulate",
    "format_sim_table",
]


def plan_cache(
    cluster: Cluster,
    profile: ModelProfile,
    global_batch: int,
    *,
    evaluate: Evaluator | None = None,
    replan: str = "best",
    **plan_kwargs: object,
) -> PlanCache:
    """The per-composition plans ``simulate`` uses: ``evaluate(alive) -> (step_time, plan)``,
    by default ``planner.plan(alive, profile, global_batch, **plan_kwargs)``'s choice
    (``math.inf`` when nothing fits). Pass one to several ``simulate`` calls on the same job
    (a checkpoint-interval sweep) to plan each composition once.

    ``replan``: ``"best"``, the planner's best plan for every composition; ``"keep"``, as the
    live controller re-plans for survivors (``elastic.control.layouts``): the whole
    cluster's layout family (strategy, dp mode, schedule, pipeline degree) on the nodes
    alive of the pools it runs on, the planner's best only where that family does not fit. The planner then looks
    at a handful of candidates per composition, not hundreds (0.09 s instead of 2 s at
    10,000 GPUs). Raises ``PlanError`` for another ``replan``."""
    if replan not in ("best", "keep"):
        raise PlanError(f"replan must be 'best' or 'keep', got {replan!r}")
    if evaluate is None:
        from .planner import plan

        first: list[Plan] = []
        pools: set[str] = set()  # the pools the whole cluster's plan runs on

        def evaluate(alive: Cluster) -> tuple[float, Plan | None]:
            ch = None
            # the family on the survivors of its own pools (a job of the H100s alone does not
            # grow into the idle A100s when an H100 node goes: was planned on every node)
            ours = alive.without_nodes(n.id for n in alive.nodes if n.pool not in pools)
            if first and replan == "keep" and ours.nodes:
                p = first[0]
                kw = {**plan_kwargs, "strategies": (p.strategy,), "dp_modes": (p.dp_mode,),
                      "schedules": (p.schedule,), "subsets": False}
                if p.is_pipeline:
                    kw["max_pp"] = p.pp_degree
                ch = plan(ours, profile, global_batch, **kw).choice  # type: ignore[arg-type]
            if ch is None or ch.estimate is None:
                ch = plan(alive, profile, global_batch, **plan_kwargs).choice  # type: ignore[arg-type]
            if ch is None or ch.estimate is None:
                return math.inf, None
            if not first:
                first.append(ch.plan)
                pools.update(alive.device(d).pool for d in ch.plan.devices)
            return ch.estimate.step_time, ch.plan

        def explain(alive: Cluster) -> str:
            return plan(alive, profile, global_batch, **plan_kwargs).explanation  # type: ignore[arg-type]

        return PlanCache(cluster, evaluate, explain)
    return PlanCache(cluster, evaluate)


def simulate(
    cluster: Cluster,
    profile: ModelProfile,
    global_batch: int,
    *,
    policies: Sequence[SimPolicy] | None = None,
    config: SimConfig | None = None,
    trace: Sequence[FailureEvent] | None = None,
    evaluate: Evaluator | None = None,
    plans: PlanCache | None = None,
    replan: str = "best",
    **plan_kwargs: object,
) -> list[PolicyResult]:
    """Run every policy (default ``RestartAll()`` and ``ElasticInPlace()``) over the same
    failure trace; one ``PolicyResult`` each.

    ``evaluate(alive_cluster) -> (step_time, plan)`` replaces the planner (tests inject a
    closed form); ``plans`` reuses a ``plan_cache`` of this cluster; ``replan`` is
    ``plan_cache``'s. Raises ``TraceError`` for
    a trace event naming no node of ``cluster`` (or a bad time or kind), and ``PlanError``
    when no plan fits the whole cluster (the message has the planner's reasons).
    """
    config = config or SimConfig()
    config.check_pools([p.name for p in cluster.pools])
    policies = (RestartAll(), ElasticInPlace()) if policies is None else tuple(policies)
    events = validate_trace(trace if trace is not None else failure_trace(cluster, config),
                            cluster, "trace")
    if plans is None:
        plans = plan_cache(cluster, profile, global_batch, evaluate=evaluate, replan=replan,
                           **plan_kwargs)
    elif plans.cluster is not cluster:
        raise PlanError("simulate(plans=...) was built for another cluster; build it with "
                        "plan_cache(cluster, ...) for this one")
    full = plans.entry(frozenset())
    if not math.isfinite(full.step_time):
        why = plans.why_nothing_fits(cluster)
        raise PlanError(f"cannot simulate: no plan fits the whole cluster {cluster.name} with "
                        f"global batch {global_batch}" + (f":\n{why}" if why else
                                                          " (the evaluator gave no step time)"))
    state = profile.n_params * (profile.bytes_per_param + profile.optimizer_bytes_per_param)
    net = min(n.network.bandwidth * n.nics for n in cluster.nodes)
    restore = RestoreTimes(
        config.restore_s if config.restore_s is not None else state / config.storage_bandwidth,
        config.peer_restore_s if config.peer_restore_s is not None
        else state / max(1, len(cluster.nodes)) / net,
    )
    upload = config.upload_s if config.upload_s is not None else state / config.storage_bandwidth
    prices = {p.name: p.device_price() for p in cluster.pools}
    setup = SimSetup(plans, events, config, restore, upload, state,
                     None if any(v is None for v in prices.values()) else
                     {k: float(v) for k, v in prices.items() if v is not None})
    return [run_policy(pol, setup) for pol in policies]

