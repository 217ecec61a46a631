"""Text for people: the planner's explanation, the ranked plan table, and ``elastic plan``.

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
from .profile import ModelProfile, profile_from_dict
from .topology import Cluster

__all__ = ["explain", "format_plan_table", "plan_main"]

_GB = 1e9


def _devices_summary(cluster: Cluster, ids: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for i in ids:
        d = cluster.device(i)
        counts[d.short] = counts.get(d.short, 0) + 1
    return " + ".join(f"{c} x {k}" for k, c in counts.items())


def explain(
    choice: Any, ranked: Sequence[Any], rejected: Sequence[Any], cluster: Cluster, global_batch: int
) -> str:
    """Why the planner chose what it chose (first line: the decision), or why nothing fits."""
    lines = []
    if choice is None:
        lines.append(
            f"no plan fits cluster {cluster.name} with global batch {global_batch}; "
            f"{len(rejected)} rejected:"
        )
        lines += [f"  - {c.rejection}" for c in rejected[:12]]
        lines.append("fix: add devices or memory, shrink the batch, or use a smaller model")
        return "\n".join(lines)
    e, p = choice.estimate, choice.plan
    peak = max(e.memory, key=lambda m: m.total)
    lines.append(
        f"chose {p.label} on {_devices_summary(cluster, p.devices)} ({choice.subset}): "
        f"predicted {e.step_time:.4g} s/step (compute {e.compute:.3g}, comm {e.comm:.3g} on "
        f"{e.link}, optimizer {e.optimizer:.3g}), peak {peak.total / _GB:.1f} GB per device"
    )
    if len(ranked) > 1:
        r = ranked[1]
        slower = r.estimate.step_time / e.step_time - 1.0
        line = f"runner-up: {r.plan.label} ({r.subset}), {slower:+.1%} step time"
        if slower < 0:
            line += (
                f"; within the tie tolerance the choice keeps more memory headroom "
                f"({choice.peak_fraction:.0%} vs {r.peak_fraction:.0%} of usable)"
            )
        lines.append(line)
    if len(set(p.shares)) > 1:
        lines.append(f"unequal shares by device speed: {list(p.shares)}")
    if rejected:
        lines.append(f"{len(rejected)} candidate(s) rejected, e.g. {rejected[0].rejection}")
    emu = sorted({cluster.device(i).label for i in p.devices if cluster.device(i).emulated})
    if emu:
        lines.append("EMULATED devices (test/demo aid, not real GPUs): " + "; ".join(emu))
    return "\n".join(lines)


def format_plan_table(result: Any, top: int | None = 20, show_rejected: int | None = 20) -> str:
    """A ranked text table of a ``PlanResult``: predicted step time, memory, rejection reasons."""
    out = [
        f"Plans for cluster {result.cluster_name}, global batch {result.global_batch}"
        + ("  [EMULATED devices]" if result.emulated else "")
    ]
    hdr = (
        f"{'#':>3}  {'plan':<40} {'devices':<22} {'step s':>9} {'compute':>9} {'comm':>9} "
        f"{'bubble':>7} {'peak GB':>8} {'of usable':>9}"
    )
    out += [hdr, "-" * len(hdr)]
    rows = result.ranked if top is None else result.ranked[:top]
    for i, c in enumerate(rows, 1):
        e = c.estimate
        peak, ratio = e.peak_memory, c.peak_fraction
        bubble = f"{e.bubble:.0%}" if c.plan.is_pipeline else "-"
        out.append(
            f"{i:>3}  {c.plan.label:<40} {c.subset:<22} {e.step_time:>9.4g} "
            f"{e.compute:>9.3g} {e.comm:>9.3g} {bubble:>7} {peak / _GB:>8.1f} "
            f"{ratio:>9.0%}"
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
) -> str:
    """What ``elastic plan`` prints: load the cluster and profile, plan, return the table.

    Raises ``ClusterFileError`` / ``ProfileError`` for bad input (messages name the fix).
    """
    from .planner import plan

    cluster = (
        cluster_file_or_dict
        if isinstance(cluster_file_or_dict, Cluster)
        else load_cluster(cluster_file_or_dict)
    )
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
    return "\n".join(head) + format_plan_table(result, top=top)
