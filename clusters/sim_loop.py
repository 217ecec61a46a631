"""One simulated job under one policy: the event loop behind ``simulator.simulate``.

Events: failures and preemptions from the trace, preemption notices, a lost node's place
filled again (a spare after ``spare_start_s``, the node itself once repaired or its capacity
back, a restarted process), a repaired node becoming a spare; and the job's own: checkpoint
commits, the end of a recovery, a drain at the step boundary after a notice. At each
membership change the policy (``sim_policies.SimPolicy``, i.e. the live policies plus time
costs) decides; the loop only keeps time, state and the bill.

Accounting is exact by construction: duration = downtime + checkpoint stalls + running time,
and running time = degraded (running slower than the whole cluster) + computed steps at
whole-cluster speed; lost steps are charged at that speed as ``recompute_s``. So duration -
kept_steps x full_step_time = downtime + stalls + degraded + recompute. A composition is never
charged as faster than the whole cluster (its plan could run there too): so degraded time is
never negative. A composition on which no plan fits counts as down. An evacuation's pause is
downtime too.

The bill: every node that is up (used, idle or waiting for the others) and every idle spare,
at its pool's price per device-hour, until the job ends; a preempted, lost or released node
costs nothing while it is gone.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import SimulationError
from .policy import GiveUp
from .sim_config import PolicyResult, SimConfig
from .sim_plans import CompositionPlan, PlanCache
from .sim_policies import JobView, Recovery, RestoreTimes, SimPolicy
from .trace import FailureEvent

__all__ = ["SimSetup", "run_policy"]


@dataclass(frozen=True)
class SimSetup:
    """What every policy's run shares: the cluster's plans, the validated trace, the config,
    restore times, the checkpoint upload time (seconds), the training state's bytes (what an
    evacuation moves) and the price per device-hour by pool (None: no bill)."""

    plans: PlanCache
    events: Sequence[FailureEvent]
    config: SimConfig
    restore: RestoreTimes
    upload_s: float
    state_bytes: float = 0.0
    prices: Mapping[str, float] | None = None


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
        self.stall_until = 0.0  # a blocking checkpoint's stall, run out across events
        self.ended = ""
        self.done = False  # reached cfg.target_steps
        self.failures = self.rollbacks = self.preemptions = self.evacuations = 0
        self.last_change = 0
        self.lost = self.down = self.degraded = self.ckpt = 0.0

    @property
    def position(self) -> int:
        return math.floor(self.step + 1e-9)

    def set_step_time(self, st: float) -> None:
        self.st = max(st, self.full_st)

    def run_to(self, t_to: float) -> None:
        """Advance the clock to ``t_to``: down, then running (checkpointing every K steps),
        stopping early at ``target_steps``."""
        if self.ended:
            self.down += t_to - self.t
            self.t = t_to
            return
        if self.t < self.down_until:
            d_end = min(self.down_until, t_to)
            self.down += d_end - self.t
            self.t = d_end
        if self.t < self.stall_until:  # the rest of a stall an event cut into
            s_end = min(self.stall_until, t_to)
            self.ckpt += s_end - self.t
            self.t = s_end
        if self.t < t_to:
            self._compute(t_to)
        self.commit(self.t)

    def _compute(self, t_to: float) -> None:
        if not math.isfinite(self.st):  # nothing fits these nodes: the job cannot run
            self.down += t_to - self.t
            self.t = t_to
            return
        k, goal = self.cfg.checkpoint_every, self.cfg.target_steps
        slow = 1 - self.full_st / self.st
        while self.t < t_to:
            nxt = (math.floor(self.step / k + 1e-9) + 1) * k
            stop = nxt if goal is None else min(nxt, goal)
            t_stop = self.t + (stop - self.step) * self.st
            if t_stop > t_to:
                self.degraded += (t_to - self.t) * slow
                self.step += (t_to - self.t) / self.st
                self.t = t_to
                return
            self.degraded += (t_stop - self.t) * slow
            self.step, self.t = float(stop), t_stop
            if goal is not None and stop >= goal:
                self.done = True
                return
            self.pending.append((self.t + self.upload_s, nxt))
            self.stall_until = self.t + self.cfg.checkpoint_stall_s  # (what an event before
            stall = min(self.cfg.checkpoint_stall_s, t_to - self.t)  # its end leaves: run_to)
            self.t += stall
            self.ckpt += stall

    def next_boundary(self) -> float:
        """When the step in flight completes (now when none is: down, or nothing fits)."""
        if self.t < self.down_until or not math.isfinite(self.st):
            return max(self.t, self.down_until)
        frac = self.step - self.position
        return self.t if frac < 1e-9 else self.t + (1 - frac) * self.st

    def commit(self, upto: float) -> None:
        while self.pending and self.pending[0][0] <= upto:
            self.committed = max(self.committed, self.pending.popleft()[1])

    def view(self, workers: int, target: int) -> JobView:
        return JobView(self.position, (self.committed,) if self.committed else (), workers,
                       target, self.failures, self.last_change)

    def apply(self, rec: Recovery, cause: str) -> None:
        """Carry out a membership change (``cause``: ``failure``, ``join``, or ``evacuate``,
        at a step boundary after a notice): the state goes to its restore step, the job
        stops a while. After a failure the step in flight is lost even when peers hold the
        state, and a buddy copy is as old as it is. An upload in flight dies with its
        workers (a failure, a restart) or is given up (an evacuation, as the live one does)."""
        if rec.restore is None or rec.restore.source == "peers":
            target = self.step
            if cause == "failure":
                target = float(min(self.position, rec.restore.step if rec.restore else
                                   self.position))
        else:
            target = float(rec.restore.step)
        if rec.rollback and self.step > target + 1e-9:
            self.rollbacks += 1
        self.lost += max(0.0, self.step - target)
        self.step = min(self.step, target)
        restart = rec.restore is not None and rec.restore.restart_all
        if cause != "join" or restart:
            self.pending.clear()
            self.stall_until = self.t  # the checkpoint stalling died with its workers
        self.down_until = max(self.down_until, self.t + rec.downtime_s)
        self.last_change = self.position

    def end(self, reason: str) -> None:
        self.ended = reason
        self.pending.clear()


class _Nodes:
    """Which nodes are down, when each comes back, the spares, and what the held ones cost."""

    def __init__(self, setup: SimSetup, push: Callable[[float, str, str], None]) -> None:
        cfg, cluster = setup.config, setup.plans.cluster
        self.cfg, self.plans = cfg, setup.plans
        self.size = {n.id: len(n.devices) for n in cluster.nodes}
        self.workers = self.target = sum(self.size.values())
        self.dead: set[str] = set()
        self.down: Counter[str] = Counter()  # self.dead by pool
        self.gone: dict[str, str] = {}  # dead nodes no longer billed (lost, preempted): pool
        self.released: set[str] = set()  # drained before their deadline
        self.back_at: dict[str, float] = {}
        self.waiting: dict[str, deque[str]] = {p.name: deque() for p in cluster.pools}
        self.repairs: dict[str, list[float]] = {p.name: [] for p in cluster.pools}
        self.spares = {p.name: cfg.spares(p.name) for p in cluster.pools}
        self._push = push
        prices = setup.prices
        self.per_s: dict[str, float] | None = None
        self.held = 0.0  # dollars: released nodes still held for a hand-over or a checkpoint
        if prices is not None:  # dollars per second of one node of each pool
            self.per_s = {p.name: p.devices_per_node * prices[p.name] / 3600.0
                          for p in cluster.pools}
            self._full = sum(self.per_s[n.pool] for n in cluster.nodes)
        self._plan: CompositionPlan | None = None

    def plan(self) -> CompositionPlan:
        """The plan for the nodes up now."""
        if self._plan is None:
            self._plan = self.plans.entry_of(self.down, lambda: self.dead)
        return self._plan

    def plan_without(self, node: str) -> CompositionPlan:
        """The plan for the nodes up now but ``node``."""
        down = self.down.copy()
        down[self.plans.pool_of(node)] += 1
        return self.plans.entry_of(down, lambda: self.dead | {node})

    def back(self, node: str) -> None:
        """``node`` is up again (the job has yet to take it in)."""
        self.dead.discard(node)
        self.down[self.plans.pool_of(node)] -= 1
        self.gone.pop(node, None)
        self.back_at.pop(node, None)
        self.workers += self.size[node]
        self._plan = None

    def hold(self, node: str, seconds: float) -> None:
        """Bill ``node`` for ``seconds`` after it left the job (released once it has handed
        its state over or written its checkpoint)."""
        if self.per_s is not None:
            self.held += self.per_s[self.plans.pool_of(node)] * max(0.0, seconds)

    def rate(self) -> float:
        """Dollars per second now: the nodes up plus the idle spares."""
        if self.per_s is None:
            return 0.0
        per_s = self.per_s
        return (self._full - sum(per_s[p] for p in self.gone.values())
                + sum(k * per_s[p] for p, k in self.spares.items()))

    def lose(self, node: str, kind: str, repair: float, now: float, gone_at: float) -> None:
        """``node`` leaves at ``now``; its capacity (a repair, a new spot node) is back
        ``repair`` (or the config's default for ``kind``) after ``gone_at``."""
        self.dead.add(node)
        self.workers -= self.size[node]
        pool = self.plans.pool_of(node)
        self.down[pool] += 1
        self._plan = None
        if kind in ("node_lost", "preempted"):  # the machine is gone: no bill until back
            self.gone[node] = pool  # (a crashed or hung process's machine is still billed)
            default = self.cfg.repair_s if kind == "node_lost" else self.cfg.preemption_return_s
            done = gone_at + (repair or default)
            self._push(done, "repaired", pool)
            heapq.heappush(self.repairs[pool], done)
            if self.spares[pool] > 0:
                self.spares[pool] -= 1
                self.back_at[node] = now + self.cfg.spare_start_s
                self._push(self.back_at[node], "back", node)
            else:
                self.waiting[pool].append(node)
        else:
            self.back_at[node] = now + (repair or self.cfg.process_restart_s)
            self._push(self.back_at[node], "back", node)

    def all_back_in(self, now: float) -> float:
        """Seconds until every node down now is back (a waiting place takes its pool's
        repaired nodes in order)."""
        latest = max((b for b in self.back_at.values()), default=now)
        for pool, queue in self.waiting.items():
            if queue:
                latest = max(latest, sorted(self.repairs[pool])[len(queue) - 1])
        return latest - now


def _notice_deadlines(events: Sequence[FailureEvent]) -> dict[int, tuple[float, float]]:
    """For each notice (by index): its node's next ``preempted`` time and ``repair_s``."""
    out: dict[int, tuple[float, float]] = {}
    open_: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.kind == "notice":
            open_[e.node] = i
        elif e.kind == "preempted" and e.node in open_:
            out[open_.pop(e.node)] = (e.time, e.repair_s or 0.0)
    return out


def run_policy(policy: SimPolicy, setup: SimSetup) -> PolicyResult:
    """Simulate ``setup.config.duration_s`` of the job under ``policy`` over the trace (or
    until it keeps ``target_steps``)."""
    cfg, plans = setup.config, setup.plans
    full_st = plans.entry(frozenset()).step_time
    job = _Job(setup, full_st)
    heap: list[tuple[float, int, str, str, str, float, float]] = []
    seq = len(setup.events)

    def push(at: float, what: str, node: str, kind: str = "", deadline: float = 0.0,
             repair: float = 0.0) -> None:
        nonlocal seq
        heapq.heappush(heap, (at, seq, what, node, kind, deadline, repair))
        seq += 1

    nodes = _Nodes(setup, push)
    deadlines = _notice_deadlines(setup.events)
    for i, e in enumerate(setup.events):
        deadline, repair = deadlines.get(i, (0.0, e.repair_s or 0.0))
        heapq.heappush(heap, (e.time, i, "notice" if e.kind == "notice" else "fail", e.node,
                              e.kind, deadline, repair))
    cost, billed_to = 0.0, 0.0

    def transfer_s(node: str) -> float:
        """Seconds to send ``node``'s share of the state over its network."""
        n = plans.cluster.node(node)
        share = setup.state_bytes / max(1, len(plans.cluster.nodes) - len(nodes.dead))
        return share / (n.network.bandwidth * n.nics)

    def evacuate(node: str, deadline: float, repair: float) -> None:
        """At a step boundary, ``deadline - job.t`` before ``node`` goes: the policy's
        decision carried out (see ``SimPolicy.on_notice``)."""
        survive = plans.survives(nodes.plan(), nodes.dead, node)
        move_s = 0.0 if survive else transfer_s(node)
        d = policy.on_notice(job.view(nodes.workers, nodes.target), deadline - job.t, move_s,
                             setup.upload_s, nodes.workers - nodes.size[node],
                             math.isfinite(nodes.plan_without(node).step_time))
        if d is None:
            return  # ignored: lost at the deadline
        path = d.path if d.path != "move" or job.t + move_s <= deadline else "recover"
        write = setup.upload_s if path == "checkpoint" else 0.0
        if path == "checkpoint" and job.t + write > deadline:
            path, write = "recover", 0.0
        busy = move_s if path == "move" else write
        nodes.hold(node, min(busy, cfg.duration_s - job.t))
        nodes.lose(node, "preempted", repair, job.t + busy, deadline)
        nodes.released.add(node)
        job.set_step_time(nodes.plan().step_time)
        job.preemptions += 1
        if path == "move":
            job.evacuations += 1
            job.apply(Recovery(policy.move_pause_s(move_s), False), "evacuate")
            return
        job.failures += 1
        if path == "checkpoint":
            job.committed = max(job.committed, job.position)
        rec = policy.on_release(path, job.view(nodes.workers, nodes.target), write, survive,
                                nodes.all_back_in(job.t), setup.restore)
        if isinstance(rec, GiveUp):
            job.end(rec.reason)
        else:
            job.apply(rec, "evacuate")

    while True:
        t_next = min(heap[0][0], cfg.duration_s) if heap else cfg.duration_s
        job.run_to(t_next)
        if not job.ended:
            cost += nodes.rate() * (job.t - billed_to)
        billed_to = job.t
        if job.done or job.t >= cfg.duration_s or not heap:
            break
        _, _, what, node, kind, deadline, repair = heapq.heappop(heap)
        if what == "repaired":  # capacity is back: it fills a waiting place or is a spare
            pool = node
            heapq.heappop(nodes.repairs[pool])
            if not nodes.waiting[pool]:
                nodes.spares[pool] += 1
                continue
            node, what = nodes.waiting[pool].popleft(), "back"
        if what == "back":
            idle = not plans.uses(nodes.plan(), nodes.dead, node)  # (the plan before it)
            nodes.back(node)
            joining = nodes.size[node]
            job.set_step_time(nodes.plan().step_time)
            if job.ended or job.t < job.down_until:
                continue  # a join during a recovery rides along with it
            if idle and not plans.uses(nodes.plan(), nodes.dead, node):
                continue  # a node the plan leaves out (another pool's): nothing to join
            rec = policy.on_join(job.view(nodes.workers - joining, nodes.target), joining,
                                 setup.restore)
            if rec is None:
                raise SimulationError(f"policy {policy.name!r} left a returning node out; the "
                                      "simulator models jobs that take every node back")
            job.apply(rec, "join")
            continue
        if what == "notice":  # acted on at the next step boundary
            if node not in nodes.dead and not job.ended:
                push(job.next_boundary(), "drain", node, kind, deadline, repair)
            continue
        if what == "drain":
            if node in nodes.dead or job.ended or job.t >= deadline:
                continue
            at = job.next_boundary()
            if at > job.t + 1e-9:  # the job's pace changed since the notice
                push(at, "drain", node, kind, deadline, repair)
                continue
            evacuate(node, deadline, repair)
            continue
        if kind == "preempted" and node in nodes.released:  # drained before its deadline
            nodes.released.discard(node)
            continue
        if node in nodes.dead:
            continue  # a node that is down cannot fail again
        survive = plans.survives(nodes.plan(), nodes.dead, node)
        idle = not plans.uses(nodes.plan(), nodes.dead, node)
        nodes.lose(node, kind, repair, job.t, job.t)
        job.set_step_time(nodes.plan().step_time)
        if job.ended or idle:  # a node the plan leaves out: no worker of the job was there
            continue  # (was: a failure, a restart-all rollback)
        job.failures += 1
        job.preemptions += kind == "preempted"
        decision = policy.on_failure(kind, job.view(nodes.workers, nodes.target), survive,
                                     nodes.all_back_in(job.t), setup.restore)
        if isinstance(decision, GiveUp):
            job.end(decision.reason)
        else:
            job.apply(decision, "failure")
    end = job.t if job.done else cfg.duration_s
    return PolicyResult(
        policy=policy.name,
        duration_s=end,
        steps=job.step,
        ideal_steps=end / full_st,
        failures=job.failures,
        rollbacks=job.rollbacks,
        lost_steps=job.lost,
        downtime_s=job.down,
        recompute_s=job.lost * full_st,
        degraded_s=job.degraded,
        checkpoint_s=job.ckpt,
        ended=job.ended,
        preemptions=job.preemptions,
        evacuations=job.evacuations,
        cost_usd=cost + nodes.held if setup.prices is not None else None,
        reached_target=None if cfg.target_steps is None else job.done,
    )
