"""Where a sweep's pruner can decide: the steps at which a trial's workers wait for it.

Optuna's pruners decide only at known steps. The median pruner answers at step ``s`` only
when ``s >= n_warmup_steps`` and ``s`` is the first reported step of its interval
(``(s - n_warmup_steps) % interval_steps == 0`` when every step is reported, as a sweep
does); successive halving, and Hyperband's brackets, only at a rung's promotion step
``min_resource * reduction_factor ** k``. At any other step ``should_prune`` is False
whatever the values, so asking it there only costs storage reads.

By default a trial's workers never wait for the pruner: the controller polls so that a
decision step's loss reaches the driver about when the step ends (``StepLog.watch_s``), and
a "prune" stops the workers at once; ``prune_lag`` measures what they trained meanwhile.
With ``pruning: {exact: true}`` the job pauses after each decision step
(``Controller(pause_after=...)``), so no step runs past the decision, at a pause's cost.
Pure: no Optuna, no Ray; the spec is the sweep file's ``study.pruner``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PruneSteps", "prune_lag"]


@dataclass(frozen=True)
class PruneSteps:
    """The decision steps of one pruner spec. ``kind`` is ``median``, ``hyperband`` or
    ``none``; ``every`` marks a spec whose steps cannot be known up front (then every step
    is a decision step)."""

    kind: str
    first: int = 0  # median: n_warmup_steps; hyperband: min_resource
    interval: int = 1  # median: interval_steps; hyperband: reduction_factor
    every: bool = False

    @classmethod
    def of(cls, pruner: dict[str, Any]) -> PruneSteps:
        """The decision steps of ``pruner`` (``{"type": ..., settings}`` as ``make_pruner``
        takes it, already checked by Optuna)."""
        kind = str(pruner.get("type", "median"))
        if kind == "none":
            return cls("none")
        if kind == "hyperband":
            lo, rf = pruner.get("min_resource", 1), pruner.get("reduction_factor", 3)
            if not (_int(lo) and _int(rf) and lo >= 1 and rf >= 2):
                return cls(kind, every=True)
            return cls(kind, int(lo), int(rf))
        warm, every = pruner.get("n_warmup_steps", 0), pruner.get("interval_steps", 1)
        if not (_int(warm) and _int(every) and warm >= 0 and every >= 1):
            return cls(kind, every=True)
        return cls(kind, int(warm), int(every))

    def decides_at(self, step: int) -> bool:
        """Whether the pruner can answer anything but "go on" after ``step``."""
        if self.kind == "none":
            return False
        if self.every:
            return True
        if self.kind == "hyperband":
            return self.next_at(step) == step
        return step >= self.first and (step - self.first) % self.interval == 0

    def next_at(self, step: int) -> int | None:
        """The first decision step at or after ``step`` (None: there is none)."""
        if self.kind == "none":
            return None
        if self.every:
            return step
        if self.kind == "hyperband":
            s = self.first
            while s < step:
                s *= self.interval
            return s
        if step <= self.first:
            return self.first
        return self.first + -(-(step - self.first) // self.interval) * self.interval


def prune_lag(history: list[dict[str, Any]], pruned_at: int,
              decided_time: float) -> dict[str, int]:
    """What a pruned trial trained past the pruner's decision, from its steps' records
    (``step``, ``time``: the step's end, ``step_time``; the workers' clocks):
    ``past_step``: steps after the decided step (the driver's lag plus the stop's);
    ``begun_after``: steps begun after the decision was made (the stop's lag: the ranks
    agree on a stop through a step's control all-reduce, which overlaps the next step, so
    the step under way and one more run: <= 1 when the stop reached the workers within a
    step); ``ended_after``: steps that ended after it."""
    later = [h for h in history if h["step"] > pruned_at]
    return {"past_step": len(later),
            "begun_after": sum(1 for h in later
                               if h["time"] - float(h.get("step_time") or 0.0) > decided_time),
            "ended_after": sum(1 for h in history if h["time"] > decided_time)}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
