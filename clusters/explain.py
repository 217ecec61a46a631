"""The planner's explanation: why it chose what it chose, or why nothing fits.

Its first line is the decision (it becomes ``Plan.reason``); then the runner-up, unequal
shares, one rejection and any emulated devices. Text only: it takes the ranked candidates and
decides nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from .candidates import Candidate
from .plan import keeps_state, more_work, trial_ran
from .topology import Cluster

__all__ = ["explain"]

_GB = 1e9


def _size(n_bytes: float) -> str:
    """GB, or MB below 0.1 GB (a small model's peak was "0.0 GB")."""
    return f"{n_bytes / _GB:.1f} GB" if n_bytes >= 0.1 * _GB else f"{n_bytes / 1e6:.3g} MB"


def _devices_summary(cluster: Cluster, ids: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for i in ids:
        d = cluster.device(i)
        counts[d.short] = counts.get(d.short, 0) + 1
    return " + ".join(f"{c} x {k}" for k, c in counts.items())


def explain(
    choice: Candidate | None,
    ranked: Sequence[Candidate],
    rejected: Sequence[Candidate],
    cluster: Cluster,
    global_batch: int,
    seen: Sequence[tuple[str, Sequence[str]]] = (),
    trial_tolerance: float = 0.05,
) -> str:
    """Why the planner chose what it chose (first line: the decision), or why nothing fits.
    ``seen``: the (strategy, device ids) the profiler's trial steps ran, and
    ``trial_tolerance`` the margin within which they go first (``planner.break_tie``)."""
    lines = []
    if choice is None or choice.estimate is None:
        lines.append(
            f"no plan fits cluster {cluster.name} with global batch {global_batch}; "
            f"{len(rejected)} rejected:"
        )
        lines += [f"  - {c.rejection}" for c in rejected[:12]]
        fewest = min((len(c.plan.devices) for c in rejected if c.plan.devices), default=1)
        if global_batch < fewest:  # every plan gives each device at least one sample
            lines.append(f"fix: a global batch of at least {fewest} (each device needs a "
                         f"sample, and the smallest set of devices planned here has {fewest}), "
                         "or a cluster file of fewer devices")
        else:
            lines.append("fix: add devices or memory, shrink the batch, or use a smaller "
                         "model")
        return "\n".join(lines)
    e, p = choice.estimate, choice.plan
    peak = max(e.memory, key=lambda m: m.total)
    # what the parts leave of the step: the fixed per-step overhead the profiler measured
    # (the step loop, the control all-reduce) and a pipeline's step-wide messages (the
    # batch's all-gather, the norm and commit all-reduces; was: not said, and the parts
    # summed to half the step; found by a new user)
    rest = e.step_time - e.compute - e.comm - e.optimizer
    what = "overhead and messages" if p.is_pipeline else "overhead"
    lines.append(
        f"chose {p.label} on {_devices_summary(cluster, p.devices)} ({choice.subset}): "
        f"predicted {e.step_time:.4g} s/step (compute {e.compute:.3g}, comm {e.comm:.3g} on "
        f"{e.link}, optimizer {e.optimizer:.3g}"
        + (f", per-step {what} {rest:.3g}" if rest > 0.005 * e.step_time else "")
        + f"), peak {_size(peak.total)} per device"
    )
    if len(ranked) > 1:
        r = ranked[1]
        slower = r.step_time / e.step_time - 1.0
        shed = next((c for c in ranked[1:] if c.step_time < e.step_time
                     and trial_ran(c.plan, seen) and not keeps_state(c.plan)),
                    None) if trial_ran(p, seen) and keeps_state(p) else None
        close = (f"; too close for the model to order (within {trial_tolerance * 100:.0f} %), "
                 "the choice is what the profiler's trial steps ran")
        used = (f"{choice.peak_fraction:.0%}" if round(choice.peak_fraction * 100) >= 1
                else "under 1%")  # (a small model's: was "0% of usable")
        spare = f", with memory to spare ({used} of usable)"
        line = f"runner-up: {r.plan.label} ({r.subset}), {slower:+.1%} step time"
        # (an equal runner-up too: zero2 beside zero1 once both reduce in buckets)
        if slower <= 0 and more_work(r.plan, p):
            line += "; within the tie tolerance the choice does less work per step" + spare
        elif shed is not None:  # a faster tried plan that shards the state
            if shed is not r:
                line += (f"; {shed.plan.label}, which a trial ran too, "
                         f"{shed.step_time / e.step_time - 1.0:+.1%}")
            line += (f"{close} and keeps every rank's state on a peer (a lost worker process "
                     f"costs no rollback){spare}")
        elif slower <= 0 and trial_ran(p, seen) and not trial_ran(r.plan, seen):
            line += close + spare
        elif slower < 0 or (slower == 0 and choice.peak_fraction < r.peak_fraction):
            line += (
                f"; within the tie tolerance the choice keeps more memory headroom "
                f"({choice.peak_fraction:.0%} vs {r.peak_fraction:.0%} of usable)"
            )
        lines.append(line)
    if len(set(p.shares)) > 1:
        alike = len({cluster.device(i).speed_key for i in p.devices}) == 1
        lines.append(f"unequal shares: {list(p.shares)}, " + (
            f"{sum(p.shares)} samples do not divide evenly by {len(p.shares)}"
            if alike and max(p.shares) - min(p.shares) <= 1 else "by device speed"))
    if rejected:
        lines.append(f"{len(rejected)} candidate(s) rejected, e.g. {rejected[0].rejection}")
    emu = sorted({cluster.device(i).label for i in p.devices if cluster.device(i).emulated})
    if emu:
        lines.append("EMULATED devices (test/demo aid, not real GPUs): " + "; ".join(emu))
    return "\n".join(lines)
