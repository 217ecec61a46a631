"""Alpha-beta times of collectives, and the collectives each data-parallel layout runs per step.

Ring all-reduce 2(n-1) alpha + 2(n-1)/n S beta; all-gather / reduce-scatter (n-1) alpha +
(n-1)/n S beta (S = unsharded bytes); point-to-point alpha + S beta. Per step, m micro-batches
(or accumulation steps), U FSDP units: dp all-reduce(grads); zero1 all-reduce(grads) +
all-gather(params); zero2 all-gather(params) + m reduce-scatter(grads); zero3 m x (2
all-gather + reduce-scatter), latency counted per unit. docs/cost-model.md has the sources.
"""

from __future__ import annotations

from strategies.traits import DP_MODES

__all__ = ["collective_time", "sync_collectives_time", "SYNC_MODES"]

SYNC_MODES = DP_MODES  # layouts whose step ends in a data-parallel gradient sync


def collective_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of one ring collective of ``nbytes`` (unsharded size) over ``n`` ranks.

    ``kind``: all_reduce, all_gather, reduce_scatter or p2p. ``beta`` is seconds per byte.
    """
    if kind == "p2p":
        return alpha + nbytes * beta if nbytes > 0 else 0.0
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    raise ValueError(f"unknown collective {kind!r}")


def sync_collectives_time(
    mode: str,
    n: int,
    param_bytes: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    micro_batches: int = 1,
    units: int = 1,
) -> float:
    """Seconds of gradient/parameter collectives per step for one data-parallel group of
    ``n`` ranks under ``mode`` (dp, zero1..3). ``units``: zero3's FSDP units (elastic wraps
    every block as one): each gathers its parameters in forward and again in backward and
    reduce-scatters its gradient, so the latency term counts per unit while the bytes are the
    same in total. Raises ``KeyError`` for an unknown mode."""
    ar = collective_time("all_reduce", grad_bytes, n, alpha, beta)
    ag = collective_time("all_gather", param_bytes, n, alpha, beta)
    rs = collective_time("reduce_scatter", grad_bytes, n, alpha, beta)
    per_unit = (max(1, units) - 1) * (n - 1) * alpha if n > 1 else 0.0
    return {
        "dp": ar,
        "zero1": ar + ag,
        "zero2": ag + micro_batches * rs,
        "zero3": micro_batches * (2 * ag + rs + 3 * per_unit),
    }[mode]
