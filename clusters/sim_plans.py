"""The simulator's plans: step time and replica survival per pool composition, cached.

Between events a simulated job runs at the step time its plan predicts for the nodes alive.
Pools are homogeneous, so the plan depends only on how many nodes of each pool are alive
(the composition): it is computed once per composition (by the planner, or an injected
evaluator) on the first alive set seen, and reused for every later alive set with the same
composition, its devices mapped by position (the i-th node of a pool onto the i-th alive
node of that pool). Which node losses that plan survives is worked out once, as positions, so
an event costs O(nodes down), not O(devices).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from .plan import Plan
from .survival import fatal_nodes
from .topology import Cluster

__all__ = ["Evaluator", "CompositionPlan", "PlanCache"]

Evaluator = Callable[[Cluster], "tuple[float, Plan | None]"]


@dataclass(frozen=True)
class CompositionPlan:
    """The plan of one composition: its step time (``math.inf``: nothing fits), the plan (None
    under an evaluator that gives none), the alive cluster it was made for, and per pool the
    positions (in that pool's alive-node order) of nodes whose loss leaves state with no live
    holder (``survival.fatal_nodes``)."""

    step_time: float
    plan: Plan | None
    seen: Cluster
    fatal: dict[str, frozenset[int]]
    used: dict[str, frozenset[int]] | None = None  # positions of the nodes the plan runs
    # on, per pool (None: every node, under an evaluator that gives no plan)


class PlanCache:
    """Plans per composition of ``cluster`` with some nodes down, from ``evaluate(alive) ->
    (step_time, plan)``; ``explain(alive)`` says why nothing fits. ``calls`` and ``seconds``
    count the evaluator's work (the planner's, by default)."""

    def __init__(
        self, cluster: Cluster, evaluate: Evaluator,
        explain: Callable[[Cluster], str] | None = None,
    ) -> None:
        self.cluster = cluster
        self._evaluate = evaluate
        self._explain = explain
        self._cache: dict[tuple[int, ...], CompositionPlan] = {}
        self._pools = [p.name for p in cluster.pools]
        self._where: dict[str, tuple[str, int]] = {}
        seen: Counter[str] = Counter()
        for n in cluster.nodes:
            self._where[n.id] = (n.pool, seen[n.pool])
            seen[n.pool] += 1
        self._alive0 = seen
        self.calls = 0
        self.seconds = 0.0

    def why_nothing_fits(self, alive: Cluster) -> str:
        """The planner's reasons why no plan fits ``alive`` ("" without a planner)."""
        return self._explain(alive) if self._explain is not None else ""

    def pool_of(self, node: str) -> str:
        return self._where[node][0]

    def entry(self, dead: Set[str]) -> CompositionPlan:
        """The plan for the cluster without ``dead``."""
        return self.entry_of(Counter(self._where[n][0] for n in dead), lambda: dead)

    def entry_of(self, down: Mapping[str, int], dead: Callable[[], Set[str]]) -> CompositionPlan:
        """``entry(dead())`` when the caller keeps ``down``, the count of the dead nodes by
        pool: O(pools) on a hit; ``dead()`` is called only for a composition not seen yet."""
        key = tuple(self._alive0[p] - down.get(p, 0) for p in self._pools)
        hit = self._cache.get(key)
        if hit is None:
            gone = dead()
            alive = self.cluster.without_nodes(gone) if gone else self.cluster
            t0 = time.perf_counter()
            # no node left (a whole-cluster outage): no plan, down until one comes back (was:
            # the planner asked to plan zero devices raised)
            st, plan = self._evaluate(alive) if alive.nodes else (0.0, None)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            hit = self._cache[key] = CompositionPlan(
                st if st > 0 else math.inf, plan, alive, _fatal_positions(plan, alive),
                _used_positions(plan, alive))
        return hit

    def survives(self, entry: CompositionPlan, dead: Set[str], node: str) -> bool:
        """Does the job on ``entry``'s plan, with ``dead`` down, keep every entry of its state
        when ``node`` (alive) is lost too?"""
        pool, pos = self._position(dead, node)
        return pos not in entry.fatal.get(pool, frozenset())

    def uses(self, entry: CompositionPlan, dead: Set[str], node: str) -> bool:
        """Does ``entry``'s plan, with ``dead`` down, run on ``node`` (alive)? A plan of some
        pools only (the A100s of an A100 + T4 cluster) leaves the others' nodes idle."""
        if entry.used is None:
            return True
        pool, pos = self._position(dead, node)
        return pos in entry.used.get(pool, frozenset())

    def _position(self, dead: Set[str], node: str) -> tuple[str, int]:
        """``node``'s pool and its position among that pool's nodes not in ``dead``."""
        pool, i = self._where[node]
        return pool, i - sum(1 for d in dead if self._where[d][0] == pool
                             and self._where[d][1] < i)


def _used_positions(plan: Plan | None, alive: Cluster) -> dict[str, frozenset[int]] | None:
    if plan is None or not plan.devices:
        return None
    return _by_position({alive.device(d).node for d in plan.devices}, alive)


def _fatal_positions(plan: Plan | None, alive: Cluster) -> dict[str, frozenset[int]]:
    if plan is None:
        return {}
    return _by_position(set(fatal_nodes(plan, lambda d: alive.device(d).node)), alive)


def _by_position(nodes: Set[str], alive: Cluster) -> dict[str, frozenset[int]]:
    """Per pool, the positions (in that pool's alive-node order) of ``nodes``."""
    seen: Counter[str] = Counter()
    out: dict[str, set[int]] = {}
    for n in alive.nodes:
        if n.id in nodes:
            out.setdefault(n.pool, set()).add(seen[n.pool])
        seen[n.pool] += 1
    return {p: frozenset(s) for p, s in out.items()}
