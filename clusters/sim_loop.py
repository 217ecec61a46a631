"""One simulated job under one policy: the event loop behind ``simulator.simulate``.

Events: failures from the trace, a lost node's place filled again (a spare after
``spare_start_s``, the node itself once repaired, a restarted process), a repaired node
becoming a spare; and the job's own: checkpoint commits, the end of a recovery. At each
membership change the policy (``sim_policies.SimPolicy``, i.e. the live policies plus time
costs) decides; the loop only keeps time and state.

Accounting is exact by construction: duration = downtime + checkpoint stalls + running time,
and running time = degraded (running slower than the whole cluster) + computed steps at
whole-cluster speed; lost steps are charged at that speed as ``recompute_s``. So duration -
kept_steps x full_step_time = downtime + stalls + degraded + recompute. A composition is never
charged as faster than the whole cluster (its plan could run there too): so degraded time is
never negative. A composition on which no plan fits counts as down.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import SimulationError
from .policy import GiveUp
from .sim_config import PolicyResult, SimConfig
from .sim_plans import PlanCache
from .sim_policies import JobView, Recovery, RestoreTimes, SimPolicy
from .trace import FailureEvent

__all__ = ["SimSetup", "run_policy"]


@dataclass(frozen=True)
class SimSetup:
    """What every policy's run shares: the cluster's plans, the validated trace, the config,
    restore times and the checkpoint upload time (seconds)."""

    plans: PlanCache
    events: Sequence[FailureEvent]
    config: SimConfig
    restore: RestoreTimes
    upload_s: float


class _Job:
    """The simulated job's clock, progress and checkpoints, and where its time went."""

    def __init__(self, setup: SimSetup, full_st: float) -> None:
        self.cfg = setup.config
        self.upload_s = setup.upload_s
        self.full_st = full_st
        self.st = full_st
        self.t = 0.0
        self.step = 0.0
        self.committed = 0
        self.pending: deque[tuple[float, int]] = deque()  # (upload done at, step)
        self.down_until = 0.0
        self.ended = ""
        self.failures = self.rollbacks = 0
        self.lost = self.down = self.degraded = self.ckpt = 0.0

    def set_step_time(self, st: float) -> None:
        self.st = max(st, self.full_st)

    def run_to(self, t_to: float) -> None:
        """Advance the clock to ``t_to``: down, then running (checkpointing every K steps)."""
        if self.ended:
            self.down += t_to - self.t
            self.t = t_to
            return
        if self.t < self.down_until:
            d_end = min(self.down_until, t_to)
            self.down += d_end - self.t
            self.t = d_end
        if self.t < t_to:
            self._compute(t_to)
        self.commit(self.t)

    def _compute(self, t_to: float) -> None:
        if not math.isfinite(self.st):  # nothing fits these nodes: the job cannot run
            self.down += t_to - self.t
            self.t = t_to
            return
        k = self.cfg.checkpoint_every
        slow = 1 - self.full_st / self.st
        while self.t < t_to:
            nxt = (math.floor(self.step / k + 1e-9) + 1) * k
            t_ck = self.t + (nxt - self.step) * self.st
            if t_ck > t_to:
                self.degraded += (t_to - self.t) * slow
                self.step += (t_to - self.t) / self.st
                self.t = t_to
                return
            self.degraded += (t_ck - self.t) * slow
            self.step, self.t = float(nxt), t_ck
            self.pending.append((self.t + self.upload_s, nxt))
            stall = min(self.cfg.checkpoint_stall_s, t_to - self.t)
            self.t += stall
            self.ckpt += stall

    def commit(self, upto: float) -> None:
        while self.pending and self.pending[0][0] <= upto:
            self.committed = max(self.committed, self.pending.popleft()[1])

    def view(self, workers: int, target: int) -> JobView:
        return JobView(math.floor(self.step + 1e-9), (self.committed,) if self.committed else (),
                       workers, target, self.failures)

    def apply(self, rec: Recovery, cause: str) -> None:
        """Carry out a recovery: the state goes to its restore step, the job stops a while.
        After a failure the step in flight is lost even when peers hold the state."""
        if rec.restore is None or rec.restore.source == "peers":
            target = math.floor(self.step + 1e-9) if cause == "failure" else self.step
        else:
            target = float(rec.restore.step)
        if rec.rollback and self.step > target + 1e-9:
            self.rollbacks += 1
        self.lost += max(0.0, self.step - target)
        self.step = min(self.step, target)
        if cause == "failure" or (rec.restore is not None and rec.restore.restart_all):
            self.pending.clear()  # shards of in-flight uploads died with their workers
        self.down_until = max(self.down_until, self.t + rec.downtime_s)

    def end(self, reason: str) -> None:
        self.ended = reason
        self.pending.clear()


def run_policy(policy: SimPolicy, setup: SimSetup) -> PolicyResult:
    """Simulate ``setup.config.duration_s`` of the job under ``policy`` over the trace."""
    cfg, plans = setup.config, setup.plans
    cluster = plans.cluster
    full_st = plans.entry(frozenset()).step_time
    job = _Job(setup, full_st)
    size = {n.id: len(n.devices) for n in cluster.nodes}
    target = sum(size.values())
    workers = target
    heap: list[tuple[float, int, str, str, str, float]] = []
    for i, e in enumerate(setup.events):
        heapq.heappush(heap, (e.time, i, "fail", e.node, e.kind, e.repair_s or 0.0))
    seq = len(setup.events)
    dead: set[str] = set()
    back_at: dict[str, float] = {}
    waiting: dict[str, deque[str]] = {p.name: deque() for p in cluster.pools}
    repairs: dict[str, list[float]] = {p.name: [] for p in cluster.pools}
    spares = {p.name: cfg.spares(p.name) for p in cluster.pools}

    def push(at: float, what: str, node: str) -> None:
        nonlocal seq
        heapq.heappush(heap, (at, seq, what, node, "", 0.0))
        seq += 1

    def all_back_in(now: float) -> float:
        """Seconds until every node down now is back (a waiting place takes its pool's
        repaired nodes in order)."""
        latest = max((b for b in back_at.values()), default=now)
        for pool, queue in waiting.items():
            if queue:
                latest = max(latest, sorted(repairs[pool])[len(queue) - 1])
        return latest - now

    while True:
        t_next = min(heap[0][0], cfg.duration_s) if heap else cfg.duration_s
        job.run_to(t_next)
        if job.t >= cfg.duration_s or not heap:
            break
        _, _, what, node, kind, repair = heapq.heappop(heap)
        if what == "repaired":  # a broken node is fixed: it fills a waiting place or waits
            pool = node
            heapq.heappop(repairs[pool])
            if not waiting[pool]:
                spares[pool] += 1
                continue
            node, what = waiting[pool].popleft(), "back"
        if what == "back":
            dead.discard(node)
            back_at.pop(node, None)
            joining, workers = size[node], workers + size[node]
            job.set_step_time(plans.entry(dead).step_time)
            if job.ended or job.t < job.down_until:
                continue  # a join during a recovery rides along with it
            rec = policy.on_join(job.view(workers - joining, target), joining, setup.restore)
            if rec is None:
                raise SimulationError(f"policy {policy.name!r} left a returning node out; the "
                                      "simulator models jobs that take every node back")
            job.apply(rec, "join")
            continue
        if node in dead:
            continue  # a node that is down cannot fail again
        before = plans.entry(dead)
        survive = plans.survives(before, dead, node)
        dead.add(node)
        workers -= size[node]
        pool = plans.pool_of(node)
        if kind == "node_lost":
            done = job.t + (repair or cfg.repair_s)
            push(done, "repaired", pool)
            heapq.heappush(repairs[pool], done)
            if spares[pool] > 0:
                spares[pool] -= 1
                back_at[node] = job.t + cfg.spare_start_s
                push(back_at[node], "back", node)
            else:
                waiting[pool].append(node)
        else:
            back_at[node] = job.t + (repair or cfg.process_restart_s)
            push(back_at[node], "back", node)
        job.set_step_time(plans.entry(dead).step_time)
        if job.ended:
            continue
        job.failures += 1
        decision = policy.on_failure(kind, job.view(workers, target), survive,
                                     all_back_in(job.t), setup.restore)
        if isinstance(decision, GiveUp):
            job.end(decision.reason)
        else:
            job.apply(decision, "failure")
    return PolicyResult(
        policy=policy.name,
        duration_s=cfg.duration_s,
        steps=job.step,
        ideal_steps=cfg.duration_s / full_st,
        failures=job.failures,
        rollbacks=job.rollbacks,
        lost_steps=job.lost,
        downtime_s=job.down,
        recompute_s=job.lost * full_st,
        degraded_s=job.degraded,
        checkpoint_s=job.ckpt,
        ended=job.ended,
    )
