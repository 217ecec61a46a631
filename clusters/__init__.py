"""clusters: hardware and cost, not PyTorch.

The device catalog, cluster files and the live inventory of a Ray cluster (one ``Cluster``
form for both), the cost model, the planner, the balancer, prices (``prices``) and the failure
and preemption simulator. Pure Python: never imports torch or elastic, and ray only where a
test reads Ray's own config validation. The failure policies the live controller runs are in
``clusters.policy``. Formulas and decisions: docs/cost-model.md.
"""

from __future__ import annotations

from .balance import RebalanceDecision, proportional_shares, rebalance_decision, stage_split
from .calibrate import Measurement, calibrate
from .catalog import (
    MARKETS,
    DeviceType,
    LinkType,
    device_type,
    device_types,
    link_type,
    link_types,
)
from .checkpoint_interval import (
    checkpoint_sweep,
    daly_interval_s,
    format_checkpoint_sweep,
    young_interval_s,
)
from .collectives import collective_time
from .cost import CostModel
from .errors import (
    BalanceError,
    ClusterFileError,
    ClustersError,
    InventoryError,
    PlanError,
    ProfileError,
    SimulationError,
    TraceError,
)
from .estimate import Estimate
from .inventory import cluster_from_launcher_config, cluster_from_ray_nodes
from .loader import cluster_to_dict, example_path, load_cluster
from .memory import MemoryBreakdown, layout_memory, model_state_bytes
from .pipeline_cost import bubble_fraction
from .plan import DP_MODES, SCHEDULES, STRATEGIES, Plan
from .planner import Candidate, PlanResult, plan
from .prices import (
    cluster_cost_per_hour,
    cost_per_1k_steps,
    parse_prices,
    plan_cost_per_hour,
    with_prices,
)
from .profile import ModelProfile, optimizer_state_bytes, profile_from_dict, transformer_profile
from .report import format_plan_table, plan_main
from .sim_config import PolicyResult, SimConfig, format_sim_table
from .sim_policies import ElasticInPlace, Recovery, RestartAll, SimPolicy, TimeCosts
from .simulator import plan_cache, simulate
from .topology import Cluster, Device, Emulation, Node, NodePool, Path
from .trace import (
    FAILURE_KINDS,
    NOTICE_KINDS,
    TRACE_KINDS,
    FailureEvent,
    failure_trace,
    llama3_trace,
    load_trace,
    poisson_trace,
    preemption_trace,
    save_trace,
)

__all__ = [
    "BalanceError",
    "bubble_fraction",
    "calibrate",
    "Candidate",
    "checkpoint_sweep",
    "Cluster",
    "cluster_cost_per_hour",
    "cluster_from_launcher_config",
    "cluster_from_ray_nodes",
    "cluster_to_dict",
    "ClusterFileError",
    "ClustersError",
    "collective_time",
    "cost_per_1k_steps",
    "CostModel",
    "daly_interval_s",
    "Device",
    "device_type",
    "device_types",
    "DeviceType",
    "DP_MODES",
    "ElasticInPlace",
    "Emulation",
    "Estimate",
    "example_path",
    "FAILURE_KINDS",
    "failure_trace",
    "FailureEvent",
    "format_checkpoint_sweep",
    "format_plan_table",
    "format_sim_table",
    "InventoryError",
    "layout_memory",
    "link_type",
    "link_types",
    "LinkType",
    "MARKETS",
    "llama3_trace",
    "load_cluster",
    "load_trace",
    "Measurement",
    "MemoryBreakdown",
    "model_state_bytes",
    "ModelProfile",
    "Node",
    "NodePool",
    "NOTICE_KINDS",
    "optimizer_state_bytes",
    "Path",
    "Plan",
    "plan",
    "parse_prices",
    "plan_cache",
    "plan_cost_per_hour",
    "plan_main",
    "PlanError",
    "PlanResult",
    "poisson_trace",
    "preemption_trace",
    "PolicyResult",
    "profile_from_dict",
    "ProfileError",
    "proportional_shares",
    "rebalance_decision",
    "RebalanceDecision",
    "Recovery",
    "RestartAll",
    "save_trace",
    "SCHEDULES",
    "SimConfig",
    "SimPolicy",
    "simulate",
    "SimulationError",
    "stage_split",
    "STRATEGIES",
    "TimeCosts",
    "TRACE_KINDS",
    "TraceError",
    "transformer_profile",
    "with_prices",
    "young_interval_s",
]
