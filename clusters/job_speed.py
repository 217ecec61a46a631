"""A job's predicted step time for each size and layout: the options a scheduler weighs.

``job_options`` asks the planner, for each candidate number of workers, for the predicted
step time of every data-parallel layout that fits the devices' memory (a size where none
fits has no option: the scheduling policies then never give the job that size). The live
scheduler calibrates it with what the running job measured (``measured_seconds_per_sample``
feeds the cost model's per-sample compute time); the simulator uses it as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from .cost import CostModel
from .errors import ClusterFileError, PlanError
from .loader import load_cluster
from .planner import plan
from .profile import ModelProfile
from .sched_policy import Option
from .topology import Cluster

__all__ = ["job_options", "uniform_cluster", "seconds_per_sample", "LAYOUTS"]

LAYOUTS = ("dp", "zero1", "zero2", "zero3")


def uniform_cluster(n: int, device: str, *, per_node: int = 8, network: str = "ib-hdr",
                    nics: int = 8) -> Cluster:
    """``n`` devices of type ``device``, ``per_node`` to a node (the last node may hold
    fewer: it becomes its own pool)."""
    full, rest = divmod(n, per_node)
    pools = []
    if full:
        pools.append({"name": "a", "device": device, "nodes": full,
                      "devices_per_node": per_node, "network": network, "nics": nics})
    if rest:
        pools.append({"name": "b", "device": device, "nodes": 1, "devices_per_node": rest,
                      "network": network, "nics": nics})
    return load_cluster({"name": f"{device}-x{n}", "pools": pools})


def seconds_per_sample(step_s: float, workers: int, global_batch: int) -> float:
    """A device's forward+backward seconds per sample from a measured step (its share of the
    batch took the whole step: communication is counted as compute, a little pessimistic)."""
    share = global_batch / max(1, workers)
    return step_s / share if share > 0 else 0.0


def job_options(profile: ModelProfile, global_batch: int, device: str, sizes: Sequence[int], *,
                layouts: Sequence[str] = LAYOUTS, model: CostModel | None = None,
                measured_s_per_sample: float | None = None, per_node: int = 8,
                network: str = "ib-hdr") -> tuple[Option, ...]:
    """One ``Option`` per (size, layout) that fits, with the planner's predicted step time.

    ``measured_s_per_sample``: the job's own forward+backward seconds per sample on one
    ``device`` (replaces the FLOPs estimate). A size larger than the global batch, or whose
    devices cannot hold the model in any layout, has no option."""
    model = model or CostModel()
    if measured_s_per_sample is not None and measured_s_per_sample > 0:
        sps = dict(model.seconds_per_sample)
        sps[device] = measured_s_per_sample
        model = replace(model, seconds_per_sample=sps)
    out: list[Option] = []
    for n in sorted(set(sizes)):
        if n < 1 or n > global_batch:
            continue
        try:
            cluster = uniform_cluster(n, device, per_node=per_node, network=network)
            res = plan(cluster, profile, global_batch, model=model, strategies=tuple(layouts),
                       subsets=False)
        except (PlanError, ClusterFileError):
            continue
        best: dict[str, float] = {}
        for c in res.ranked:
            if c.estimate is None or not math.isfinite(c.step_time):
                continue
            name = c.plan.strategy
            if name not in best or c.step_time < best[name]:
                best[name] = c.step_time
        out += [Option(n, name, t) for name, t in sorted(best.items())]
    return tuple(out)
