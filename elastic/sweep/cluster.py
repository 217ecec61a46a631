"""The sweep's Ray: attach to the cluster (or start a local one) and size the concurrency.

The one module of ``elastic.sweep`` that imports Ray. Trials themselves reach the cluster
through ``elastic.fit``; this only decides where the sweep process attaches and how many
trials the cluster holds at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import JobConfig
from ..errors import ClusterError
from .sweep_file import SweepConfig

__all__ = ["connect", "disconnect", "concurrency"]


def connect(probes: list[JobConfig], say: Callable[[str], Any] | None = None) -> bool:
    """Attach to the job's Ray cluster (``ray_address``, ``RAY_ADDRESS``), use the Ray this
    process has, or start a local one sized for the largest trial; True if this call
    started (or attached) Ray, which ``disconnect`` then ends. ``ClusterError`` when the
    cluster cannot be reached."""
    import ray

    if ray.is_initialized():
        return False
    from ..ray_connect import connect as attach_or_start

    need = max(c.max_world * float(c.resources_per_worker.get("CPU", 1)) for c in probes)
    attach_or_start(probes[0].ray_address, need, say)  # (say: attached to `ray start`'s)
    return True


def disconnect(started: bool) -> None:
    """End the Ray connection ``connect`` made (nothing if it found Ray already running)."""
    if started:
        import ray

        ray.shutdown()


def concurrency(cfg: SweepConfig, probes: list[JobConfig]) -> tuple[int, str]:
    """How many trials the cluster holds at once (each at its largest), capped by
    ``max_concurrent``, and why fewer than ``max_concurrent`` ("" when not fewer);
    ``ClusterError`` if not even one fits."""
    import ray

    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for c in probes:
        res = dict(c.resources_per_worker)
        res.setdefault("CPU", 1)
        if c.use_gpu or (c.use_gpu is None and total.get("GPU", 0) > 0):
            res["GPU"] = max(1.0, float(res.get("GPU", 1)))
        for k, v in res.items():
            need[k] = max(need.get(k, 0.0), float(v) * c.max_world)
    fits = min((int(total.get(k, 0) // v) for k, v in need.items() if v > 0), default=1)
    if fits < 1:
        raise ClusterError(f"one trial needs {need} but the cluster has {total}. Fix: search "
                           "smaller num_workers/resources_per_worker, or add nodes.")
    n = max(1, min(fits, cfg.max_concurrent or fits))
    if not cfg.max_concurrent or n >= cfg.max_concurrent:
        return n, ""
    has = ", ".join(f"{total.get(k, 0):g} {k}" for k in need)
    one = ", ".join(f"{v:g} {k}" for k, v in need.items())
    return n, (f" (max_concurrent is {cfg.max_concurrent}, but the cluster has {has} and one "
               f"trial at its largest takes {one})")
