"""One policy over one failure trace: the event loop behind ``simulator.simulate``.

Accounting is exact by construction: duration = downtime + checkpoint stalls + running time,
and running time = degraded (running slower than the full cluster) + computed steps at
full-cluster speed; lost steps are charged at full-cluster speed as ``recompute_s``. So
duration - kept_steps x full_step_time = downtime + stalls + degraded + recompute.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .plan import Plan
from .topology import Cluster

__all__: list[str] = []


def run_policy(
    pol: Any,
    cluster: Cluster,
    events: Sequence[Any],
    config: Any,
    step_of: Callable[[Cluster], tuple[float, Plan | None]],
    state_bytes: float,
    survive: Callable[[Plan | None, Cluster, str], bool],
) -> Any:
    from .simulator import PolicyResult

    full_st, plan = step_of(cluster)
    k = config.checkpoint_every
    upload = (
        config.upload_s if config.upload_s is not None else state_bytes / config.storage_bandwidth
    )
    restore = (
        config.restore_s if config.restore_s is not None else state_bytes / config.storage_bandwidth
    )
    net = min(n.network.bandwidth * n.nics for n in cluster.nodes)
    peer_s = (
        config.peer_restore_s
        if config.peer_restore_s is not None
        else state_bytes / max(1, len(cluster.nodes)) / net
    )
    heap: list[tuple[float, int, str, str, float]] = []
    for i, e in enumerate(events):
        heapq.heappush(
            heap,
            (e.time, i, "fail", e.node, e.repair_s if e.repair_s is not None else config.repair_s),
        )
    seq = len(events)
    dead: set[str] = set()
    alive, st = cluster, full_st
    t = step = 0.0
    committed = 0.0
    pending: deque[tuple[float, float]] = deque()
    down_until = 0.0
    acc = dict(failures=0, rollbacks=0, lost=0.0, down=0.0, degraded=0.0, ckpt=0.0)

    def advance(t_to: float) -> None:
        nonlocal t, step
        while t < t_to:
            nxt = (math.floor(step / k + 1e-9) + 1) * k
            t_ck = t + (nxt - step) * st
            if t_ck <= t_to:
                acc["degraded"] += (t_ck - t) * (1 - full_st / st)
                step, t = float(nxt), t_ck
                pending.append((t + upload, step))
                stall = min(config.checkpoint_stall_s, t_to - t)
                t += stall
                acc["ckpt"] += stall
            else:
                acc["degraded"] += (t_to - t) * (1 - full_st / st)
                step += (t_to - t) / st
                t = t_to

    def commit(upto: float) -> None:
        nonlocal committed
        while pending and pending[0][0] <= upto:
            committed = max(committed, pending.popleft()[1])

    def rollback() -> None:
        nonlocal step
        acc["lost"] += step - committed
        acc["rollbacks"] += 1
        step = committed
        pending.clear()  # shards of in-flight uploads died with the group

    duration = config.duration_s
    while True:
        t_next = min(heap[0][0], duration) if heap else duration
        if t < down_until:
            d_end = min(down_until, t_next)
            acc["down"] += d_end - t
            t = d_end
        if t >= down_until and t < t_next:
            advance(t_next)
        commit(t)
        if t >= duration or not heap:
            if t < duration:  # no more events: run (or stay down) to the end
                if t < down_until:
                    acc["down"] += min(down_until, duration) - t
                    t = min(down_until, duration)
                advance(duration)
                commit(duration)
            break
        _, _, kind, node, repair = heapq.heappop(heap)
        recovering = t < down_until
        if kind == "fail":
            if node in dead:
                continue
            old_alive, old_plan = alive, plan
            dead.add(node)
            acc["failures"] += 1
            heapq.heappush(heap, (t + repair, seq, "repair", node, 0.0))
            seq += 1
            alive = cluster.without_nodes(dead)
            st, plan = step_of(alive)
            rec = pol.on_failure(survive(old_plan, old_alive, node), restore, peer_s)
            if rec.rollback:
                rollback()
            down_until = t + rec.downtime_s
        else:
            dead.discard(node)
            alive = cluster.without_nodes(dead)
            st, plan = step_of(alive)
            if not recovering:  # a join during a recovery rides along with it
                rec = pol.on_join(restore)
                if rec.rollback:
                    rollback()
                down_until = t + rec.downtime_s
    return PolicyResult(
        policy=pol.name,
        duration_s=duration,
        steps=step,
        ideal_steps=duration / full_st,
        failures=int(acc["failures"]),
        rollbacks=int(acc["rollbacks"]),
        lost_steps=acc["lost"],
        downtime_s=acc["down"],
        recompute_s=acc["lost"] * full_st,
        degraded_s=acc["degraded"],
        checkpoint_s=acc["ckpt"],
    )
