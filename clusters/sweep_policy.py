"""Sweeps: how many workers a trial promoted by successive halving (or Hyperband) gets.

Successive halving keeps the best ``1 / reduction_factor`` of the trials at each rung and
lets them train on; fewer trials run at each higher rung, so each can have more workers
without the sweep using more. ``PromotionPolicy.decide`` says, when a trial has just been
promoted, how many workers it should train on from there: ``start * growth ** rung``,
within the job's ``min_workers..max_workers`` and the workers free for it, never fewer
than it has (a promotion is no reason to shrink). The live sweep
(``elastic.sweep.runner``) carries a ``Grow`` out as the job's in-place ``scale`` request
at the step boundary of the decision; ``simulate_halving`` runs the same policy over a
synthetic set of trials.

``GatePolicy`` is a pruner's rule handed to a trial's workers ahead of a decision step (a
``PruneGate``): the median (percentile) pruner's, a threshold from the study's complete
trials against the trial's best value so far as the driver knows it, or successive
halving's (Hyperband's brackets), a threshold from the values the other trials of its
bracket reached at the same rung against the trial's value at the rung's step. The
workers decide at the step's end,
with the loss they agreed on, whether the pruner would stop them, and stop there, without
waiting for the driver (``elastic.worker.loop``, ``elastic.sweep.gates``). Pure: no Ray, no
Optuna, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PromotionObservation", "Grow", "Stay", "PromotionPolicy", "HalvingRun",
           "simulate_halving", "PruneGate", "GateObservation", "Prune", "GoOn", "GatePolicy"]


@dataclass(frozen=True)
class PromotionObservation:
    """A trial just promoted: ``rung`` rungs passed (1 after its first promotion),
    ``workers`` it trains on, ``start`` the workers it started with, its size limits, and
    ``free``: workers the cluster has free for it (None: unknown; the job's scale request
    then waits for room and is refused after a while, the trial training on meanwhile)."""

    rung: int
    workers: int
    start: int
    min_workers: int
    max_workers: int
    free: int | None = None


@dataclass(frozen=True)
class Grow:
    n: int
    reason: str


@dataclass(frozen=True)
class Stay:
    reason: str


@dataclass(frozen=True)
class PromotionPolicy:
    """``growth``: the factor per rung passed (1: promoted trials keep their size)."""

    growth: float = 2.0

    def want(self, rung: int, start: int, lo: int, hi: int) -> int:
        """The size a trial that passed ``rung`` rungs is meant to have."""
        n = int(math.floor(start * self.growth ** max(0, rung) + 1e-9))
        return max(lo, min(hi, n))

    def decide(self, obs: PromotionObservation) -> Grow | Stay:
        want = self.want(obs.rung, obs.start, obs.min_workers, obs.max_workers)
        cap = want if obs.free is None else min(want, obs.workers + max(0, obs.free))
        if want <= obs.workers:
            return Stay(f"rung {obs.rung}: {obs.workers} workers already "
                        f"{'reach' if want == obs.workers else 'exceed'} its {want}")
        if cap <= obs.workers:
            return Stay(f"rung {obs.rung}: wants {want} workers, none free")
        short = f" ({want} wanted, {obs.free} free)" if cap < want else ""
        return Grow(cap, f"promoted to rung {obs.rung}: {obs.workers} -> {cap} workers{short}")


@dataclass(frozen=True)
class PruneGate:
    """A pruner's decision at ``step``, known before the step runs.

    ``rule="best"`` (the percentile pruner): prune iff the trial's best value over its
    steps is worse than ``threshold`` (the percentile of the complete trials' values at
    ``step``; NaN when too few have one: then only a trial with no finite value is pruned,
    as Optuna's ``PercentilePruner`` does). ``best``: the trial's best value over its steps
    up to ``through`` as the driver has them (NaN: none finite; None: none at all); the
    workers take steps ``through + 1 .. step`` from the losses they agreed on.

    ``rule="at_step"`` (successive halving at a rung's promotion step): prune iff the
    value at ``step`` is NaN or worse than ``threshold`` (the value the trial must reach
    to be promoted: +inf when minimizing, -inf when maximizing, if no other trial has
    reached the rung; NaN when every value is pruned, too few trials having reached it for
    the pruner's ``bootstrap_count``); ``best`` is unused and ``through`` is ``step - 1``.

    ``version`` (> 0) is new for each gate the driver sends: the ranks apply a gate only
    when every rank holds the same one."""

    step: int
    threshold: float
    best: float | None
    through: int
    maximize: bool
    version: int
    rule: str = "best"


@dataclass(frozen=True)
class GateObservation:
    """The trial's values at steps ``gate.through + 1 .. gate.step``, in order."""

    gate: PruneGate
    values: tuple[float, ...]


@dataclass(frozen=True)
class Prune:
    reason: str


@dataclass(frozen=True)
class GoOn:
    reason: str


class GatePolicy:
    """Optuna's rule at a decision step, over a ``PruneGate``: ``PercentilePruner``'s (the
    trial's best value, NaN ignored, every value NaN prunes) or
    ``SuccessiveHalvingPruner``'s (the value at the step; NaN prunes) against the
    threshold."""

    def decide(self, obs: GateObservation) -> Prune | GoOn:
        g = obs.gate
        if g.rule == "at_step":
            if not obs.values:
                return Prune(f"step {g.step}: no value")  # never built so (through = step-1)
            v = obs.values[-1]
            if math.isnan(v):
                return Prune(f"step {g.step}: the value is NaN")
            if math.isnan(g.threshold):
                return Prune(f"step {g.step}: too few trials at the rung to promote any")
            worse = v < g.threshold if g.maximize else v > g.threshold
            says = f"step {g.step}: {v:.6g} against the rung's promotion bar {g.threshold:.6g}"
            return Prune(says) if worse else GoOn(says)
        vals = ([] if g.best is None else [g.best]) + list(obs.values)
        finite = [v for v in vals if not math.isnan(v)]
        if not finite:
            return Prune(f"step {g.step}: no finite value")
        best = max(finite) if g.maximize else min(finite)
        if math.isnan(g.threshold):
            return GoOn(f"step {g.step}: too few complete trials with a value there")
        worse = best < g.threshold if g.maximize else best > g.threshold
        says = f"step {g.step}: best {best:.6g} against the percentile {g.threshold:.6g}"
        return Prune(says) if worse else GoOn(says)


@dataclass(frozen=True)
class HalvingRun:
    """What ``simulate_halving`` found: the sweep's wall time, worker-seconds spent, and
    each trial's final size."""

    seconds: float
    worker_seconds: float
    sizes: tuple[int, ...]


def simulate_halving(scores: list[float], *, steps: int, step_s: float, min_resource: int,
                     reduction_factor: int, capacity: int, start: int, max_workers: int,
                     policy: PromotionPolicy, efficiency: float = 0.9) -> HalvingRun:
    """Successive halving over trials whose quality is ``scores`` (lower is better; a
    trial's rank among those at a rung decides its promotion, as Optuna's pruner does),
    rung by rung: every trial of a rung trains to its promotion step together on
    ``capacity`` workers (trials that do not fit wait for the next round), the best
    ``1/reduction_factor`` go on, sized by ``policy``. A step on ``n`` workers takes
    ``step_s / (1 + (n - 1) * efficiency)``. Synchronous halving, one bracket: what the
    policy changes, not a replay of Optuna's asynchronous rungs."""
    alive = list(range(len(scores)))
    size = {i: start for i in alive}
    done_steps = dict.fromkeys(alive, 0)
    t = ws = 0.0
    rung, target = 0, min_resource
    while alive:
        target = min(target, steps)
        pending = list(alive)
        while pending:  # rounds of trials that fit side by side
            batch, used = [], 0
            for i in pending:
                if used + size[i] <= capacity:
                    batch.append(i)
                    used += size[i]
            if not batch:
                raise ValueError(f"a trial of {size[pending[0]]} workers does not fit in "
                                 f"{capacity}")
            secs = [(target - done_steps[i]) * step_s / (1 + (size[i] - 1) * efficiency)
                    for i in batch]
            t += max(secs)
            ws += sum(s * size[i] for s, i in zip(secs, batch, strict=True))
            for i in batch:
                done_steps[i] = target
            pending = [i for i in pending if i not in batch]
        if target >= steps:
            break
        keep = max(1, len(alive) // reduction_factor)
        alive = sorted(alive, key=lambda i: scores[i])[:keep]
        rung += 1
        free = capacity - sum(size[i] for i in alive)
        for i in alive:
            d = policy.decide(PromotionObservation(rung, size[i], start, 1, max_workers, free))
            if isinstance(d, Grow):
                free -= d.n - size[i]
                size[i] = d.n
        target *= reduction_factor
    return HalvingRun(t, ws, tuple(size[i] for i in sorted(size)))
