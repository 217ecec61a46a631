"""Which node losses leave part of a plan's state with no live holder.

Recovery from peers (``policy.InPlaceRecovery``) needs every entry of the training state on a
worker that survived. Whether it is depends on the layout (which layouts keep whole copies of
every rank's state on its data-parallel peers) and on where the ranks sit. ``fatal_nodes`` is
the one place that decides it: the simulator asks it once per cached plan; which layouts keep
replicas is ``strategies.traits`` (torch-free), the table the live controller's layouts
follow too.
"""

from __future__ import annotations

from collections.abc import Callable

from .plan import Plan, keeps_state

__all__ = ["fatal_nodes"]



def fatal_nodes(plan: Plan | None, node_of: Callable[[str], str]) -> frozenset[str]:
    """Nodes whose loss alone leaves some entry of ``plan``'s state with no live holder.

    ``node_of(device_id)`` names a device's node. Replica groups: every rank of a dp/ZeRO
    plan; the ranks of one stage of a pipeline. Under a replicated layout (dp; a pipeline
    whose ``dp_mode`` is dp with at least two replicas) a node is fatal when a whole replica
    group sits on it; under any other layout every node holding a rank is (its shards exist
    nowhere else). A node that holds no rank is never fatal; ``plan=None`` has no state.
    """
    if plan is None:
        return frozenset()
    nodes = [node_of(d) for d in plan.devices]
    if not keeps_state(plan):
        return frozenset(nodes)
    dp = plan.dp_degree if plan.is_pipeline else plan.world_size
    groups = [nodes[j * dp:(j + 1) * dp] for j in range(len(nodes) // dp)]
    return frozenset(g[0] for g in groups if len(set(g)) == 1)
