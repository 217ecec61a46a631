"""How often to checkpoint: Young's and Daly's first-order optimum, next to a simulated sweep.

Young (1974): tau = sqrt(2 delta M); Daly (2006), "A higher order estimate of the optimum
checkpoint interval for restart dumps": tau = sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 +
(delta / 2M) / 9) - delta for delta < 2M, else M. tau is the compute time between
checkpoints, delta the time a checkpoint costs the job (a blocking save: the stall), M the
job's mean time between failures. Both assume every failure rolls back to the last
checkpoint (restart-all). An asynchronous checkpoint (no stall) has delta ~ 0, and the
formulas then say "as often as the uploads allow": the sweep is what answers there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from .profile import ModelProfile
from .sim_config import PolicyResult, SimConfig
from .sim_plans import PlanCache
from .sim_policies import SimPolicy
from .simulator import plan_cache, simulate
from .topology import Cluster
from .trace import FailureEvent

__all__ = ["young_interval_s", "daly_interval_s", "checkpoint_sweep", "format_checkpoint_sweep"]


def young_interval_s(checkpoint_s: float, mttf_s: float) -> float:
    """Young's optimum seconds of compute between checkpoints: sqrt(2 delta M)."""
    _check(checkpoint_s, mttf_s)
    return math.sqrt(2 * checkpoint_s * mttf_s)


def daly_interval_s(checkpoint_s: float, mttf_s: float) -> float:
    """Daly's higher-order optimum (module docstring); ``mttf_s`` itself when delta >= 2M."""
    _check(checkpoint_s, mttf_s)
    if checkpoint_s >= 2 * mttf_s:
        return mttf_s
    x = checkpoint_s / (2 * mttf_s)
    return math.sqrt(2 * checkpoint_s * mttf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def _check(checkpoint_s: float, mttf_s: float) -> None:
    if not (checkpoint_s >= 0 and mttf_s > 0 and math.isfinite(checkpoint_s)):
        raise ValueError(f"need a checkpoint cost >= 0 and an MTTF > 0 (seconds), got "
                         f"{checkpoint_s!r} and {mttf_s!r}")


def checkpoint_sweep(
    cluster: Cluster,
    profile: ModelProfile,
    global_batch: int,
    every: Sequence[int],
    *,
    policy: SimPolicy,
    config: SimConfig,
    trace: Sequence[FailureEvent],
    plans: PlanCache | None = None,
    **plan_kwargs: object,
) -> list[tuple[int, PolicyResult]]:
    """``policy``'s result for each checkpoint interval in ``every`` (steps), over one trace,
    planning each pool composition once."""
    plans = plans or plan_cache(cluster, profile, global_batch, **plan_kwargs)  # type: ignore[arg-type]
    out = []
    for k in every:
        (r,) = simulate(cluster, profile, global_batch, policies=[policy],
                        config=replace(config, checkpoint_every=k), trace=trace, plans=plans)
        out.append((k, r))
    return out


def format_checkpoint_sweep(
    rows: Sequence[tuple[int, PolicyResult]], step_time_s: float, checkpoint_s: float,
    mttf_s: float,
) -> str:
    """The sweep's goodput per interval, its best, and Young's and Daly's interval in steps
    beside it (``step_time_s``: the whole cluster's step)."""
    lines = [f"{'every (steps)':>14}{'goodput':>9}{'rollbacks':>10}{'lost steps':>11}"]
    best = max(rows, key=lambda kr: kr[1].goodput)
    for k, r in rows:
        mark = "  <- best swept" if (k, r) == best else ""
        lines.append(f"{k:>14}{r.goodput:>9.2%}{r.rollbacks:>10}{r.lost_steps:>11.0f}{mark}")
    if checkpoint_s > 0 and math.isfinite(mttf_s):
        y, d = young_interval_s(checkpoint_s, mttf_s), daly_interval_s(checkpoint_s, mttf_s)
        lines.append(
            f"swept optimum {best[0]} steps ({best[0] * step_time_s / 60:.0f} min); Young "
            f"{y / step_time_s:.0f} steps ({y / 60:.0f} min), Daly {d / step_time_s:.0f} steps "
            f"({d / 60:.0f} min), for a {checkpoint_s:.0f} s checkpoint and a "
            f"{mttf_s / 3600:.2f} h job MTTF")
    else:
        lines.append(f"swept optimum {best[0]} steps; Young/Daly need a blocking checkpoint "
                     "cost > 0 and failures")
    return "\n".join(lines)
