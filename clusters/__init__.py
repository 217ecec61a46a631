"""clusters: hardware and cost, not PyTorch.

The device catalog, cluster files and the live inventory of a Ray cluster (one ``Cluster``
form for both), the cost model, the planner, the balancer and the failure simulator. Pure
Python: never imports torch or elastic, and ray only where a test reads Ray's own config
validation. Formulas and decisions: docs/cost-model.md.
"""

from __future__ import annotations

from .balance import RebalanceDecision, proportional_shares, rebalance_decision, stage_split
from .calibrate import Measurement, calibrate
from .catalog import DeviceType, LinkType, device_type, device_types, link_type, link_types
from .collectives import collective_time
from .cost import CostModel
from .errors import (
    BalanceError,
    ClusterFileError,
    ClustersError,
    InventoryError,
    PlanError,
    ProfileError,
)
from .estimate import Estimate
from .inventory import cluster_from_launcher_config, cluster_from_ray_nodes
from .loader import cluster_to_dict, example_path, load_cluster
from .memory import MemoryBreakdown, layout_memory, model_state_bytes
from .pipeline_cost import bubble_fraction
from .plan import DP_MODES, SCHEDULES, STRATEGIES, Plan
from .planner import Candidate, PlanResult, plan
from .profile import ModelProfile, optimizer_state_bytes, profile_from_dict, transformer_profile
from .report import format_plan_table, plan_main
from .simulator import (
    ElasticInPlace,
    FailureEvent,
    PolicyResult,
    Recovery,
    RestartAll,
    SimConfig,
    failure_trace,
    format_sim_table,
    simulate,
)
from .topology import Cluster, Device, Emulation, Node, NodePool, Path

__all__ = [
    "BalanceError",
    "Candidate",
    "Cluster",
    "ClusterFileError",
    "ClustersError",
    "CostModel",
    "DP_MODES",
    "Device",
    "DeviceType",
    "ElasticInPlace",
    "Emulation",
    "Estimate",
    "FailureEvent",
    "InventoryError",
    "LinkType",
    "Measurement",
    "MemoryBreakdown",
    "ModelProfile",
    "Node",
    "NodePool",
    "Path",
    "Plan",
    "PlanError",
    "PlanResult",
    "PolicyResult",
    "ProfileError",
    "RebalanceDecision",
    "Recovery",
    "RestartAll",
    "SCHEDULES",
    "STRATEGIES",
    "SimConfig",
    "bubble_fraction",
    "calibrate",
    "cluster_from_launcher_config",
    "cluster_from_ray_nodes",
    "cluster_to_dict",
    "collective_time",
    "device_type",
    "device_types",
    "example_path",
    "failure_trace",
    "format_plan_table",
    "format_sim_table",
    "link_type",
    "layout_memory",
    "link_types",
    "load_cluster",
    "model_state_bytes",
    "optimizer_state_bytes",
    "plan",
    "plan_main",
    "profile_from_dict",
    "proportional_shares",
    "rebalance_decision",
    "simulate",
    "stage_split",
    "transformer_profile",
]
