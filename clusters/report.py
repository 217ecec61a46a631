"""Text for people: the ranked plan table, and ``elastic plan``.

``plan_main`` is what the CLI calls; it returns the text and prints nothing, so tests (and the
CLI) decide where it goes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .cost import CostModel
from .loader import load_cluster
from .plan import STRATEGIES
from .planner import PlanResult, plan
from .prices import cost_per_1k_steps, describe_prices, plan_cost_per_hour, with_prices
from .profile import ModelProfile, profile_from_dict
from .topology import Cluster

__all__ = ["format_plan_table", "plan_main"]

_GB = 1e9


def _usd(v: float) -> str:
    """Dollars to the cent, or three significant digits below a dollar (a toy model's
    1,000 steps cost fractions of a cent)."""
    return f"{v:,.2f}" if v >= 1 or v == 0 else f"{v:.3g}"


def format_plan_table(
    result: PlanResult, top: int | None = 20, show_rejected: int | None = 20,
    cluster: Cluster | None = None,
) -> str:
    """A ranked text table of a ``PlanResult``: predicted step time, memory, rejection reasons;
    with the ``cluster`` it was planned on, what each plan costs per hour (the devices it
    uses, at their pools' prices) and per 1,000 steps at its predicted step time, where
    every device it uses has a price."""
    out = [
        f"Plans for cluster {result.cluster_name}, global batch {result.global_batch}"
        + ("  [EMULATED devices]" if result.emulated else "")
    ]
    if cluster is not None:
        out.append(describe_prices(cluster))
    hdr = (
        f"{'#':>3}  {'plan':<40} {'devices':<22} {'step s':>9} {'compute':>9} {'comm':>9} "
        f"{'bubble':>7} {'peak GB':>8} {'of usable':>9}"
        + (f" {'$/h':>9} {'$/1k steps':>10}" if cluster is not None else "")
    )
    out += [hdr, "-" * len(hdr)]
    rows = result.ranked if top is None else result.ranked[:top]
    for i, c in enumerate(rows, 1):
        e = c.estimate
        assert e is not None, "ranked candidates are estimated"
        peak, ratio = e.peak_memory, c.peak_fraction
        bubble = f"{e.bubble:.0%}" if c.plan.is_pipeline else "-"
        cost = ""
        if cluster is not None:
            per_h = plan_cost_per_hour(c.plan, cluster)
            cost = (f" {'-':>9} {'-':>10}" if per_h is None else
                    f" {per_h:>9,.2f} {_usd(cost_per_1k_steps(per_h, e.step_time)):>10}")
        out.append(
            f"{i:>3}  {c.plan.label:<40} {c.subset:<22} {e.step_time:>9.4g} "
            f"{e.compute:>9.3g} {e.comm:>9.3g} {bubble:>7} {peak / _GB:>8.1f} "
            f"{ratio:>9.0%}{cost}"
        )
    if top is not None and len(result.ranked) > top:
        out.append(f"     ... {len(result.ranked) - top} more fitting plan(s)")
    if result.rejected and show_rejected != 0:
        out.append(f"Rejected ({len(result.rejected)}):")
        rej = result.rejected if show_rejected is None else result.rejected[:show_rejected]
        out += [f"  - [{c.subset}] {c.rejection}" for c in rej]
        if show_rejected is not None and len(result.rejected) > show_rejected:
            out.append(f"  ... {len(result.rejected) - show_rejected} more")
    out.append("")
    out.append(result.explanation)
    return "\n".join(out)


def plan_main(
    cluster_file_or_dict: str | os.PathLike[str] | Mapping[str, Any] | Cluster,
    model_profile_dict: Mapping[str, Any] | ModelProfile,
    global_batch: int,
    *,
    optimizer: str | None = None,
    strategies: Sequence[str] | None = None,
    model: CostModel | None = None,
    top: int | None = 20,
    prices: Mapping[str, float] | None = None,
) -> str:
    """What ``elastic plan`` prints: load the cluster and profile, plan, return the table,
    with each plan's cost per hour and per 1,000 steps (``prices``: US dollars per
    device-hour by pool name, device type or market, over the cluster file's and the
    catalog's; ``prices.with_prices``).

    Raises ``ClusterFileError`` / ``ProfileError`` for bad input (messages name the fix).
    """
    cluster = (
        cluster_file_or_dict
        if isinstance(cluster_file_or_dict, Cluster)
        else load_cluster(cluster_file_or_dict)
    )
    if prices:
        cluster = with_prices(cluster, prices)
    profile = (
        model_profile_dict
        if isinstance(model_profile_dict, ModelProfile)
        else profile_from_dict(model_profile_dict)
    )
    result = plan(
        cluster,
        profile,
        global_batch,
        optimizer=optimizer,
        model=model,
        strategies=tuple(strategies or STRATEGIES),
    )
    head = [
        cluster.describe(),
        f"model {profile.name}: {profile.n_params / 1e9:.3g} B params, "
        f"{profile.n_blocks} blocks, {profile.precision}, "
        f"optimizer {profile.optimizer_bytes_per_param} B/param",
        "",
    ]
    return "\n".join(head) + format_plan_table(result, top=top, cluster=cluster)
