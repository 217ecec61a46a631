"""The record of completed steps: history, the run directory's logs, the view, ``on_step``.

``StepLog`` owns the job's history (one entry per completed step, in order, each once) and
its metrics and data logs. The controller feeds it the workers' drained metrics; a step
that completed while a worker was lost (its metrics never arrived) is recorded from the plan
in force (``record(step, None, ...)``), so ``data_log.jsonl`` shows every completed step once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from strategies import StrategySpec

from ..data import share_bounds
from ..events import RunLog
from ..view import View

__all__ = ["StepLog"]


class StepLog:
    """History and logs of one job. Owned by the controller's thread."""

    def __init__(self, log: RunLog | None, view: View,
                 on_step: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.log = log
        self.view = view
        self.on_step = on_step
        self.history: list[dict[str, Any]] = []
        self.fresh = False  # whether the last ingest recorded a step

    @property
    def next_step(self) -> int:
        """The first step not recorded yet."""
        return self.history[-1]["step"] + 1 if self.history else 0

    def last(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    def record(self, step: int, m: dict[str, Any] | None, spec: StrategySpec,
               generation: int) -> bool:
        """Record completed ``step`` once (metrics ``m`` of rank 0, or None when it completed
        while a worker was lost): history, metrics log, view, and the data log line saying
        which rank trained which sample range of it. Returns True when ``on_step`` asked to
        stop."""
        if self.history and step <= self.history[-1]["step"]:
            return False
        gen = m["generation"] if m else generation
        entry: dict[str, Any] = {
            "step": step, "loss": m["loss"] if m else float("nan"),
            "samples_per_s": m["samples_per_s"] if m else 0.0,
            "step_time": m["step_time"] if m else 0.0, "world_size": spec.world_size,
            "strategy": spec.name, "time": m["time"] if m else time.time(), "generation": gen}
        for key in ("lr", "grad_norm", "eval_loss", "skipped"):
            if m is not None and key in m:
                entry[key] = m[key]
        if m is None:
            entry["note"] = "completed while a worker was lost; its loss was not reported"
        self.history.append(entry)
        if self.log is not None:
            self.log.metric(entry)  # strict JSON: NaN written as null
            bounds = [share_bounds(spec.shares, r) for r in range(spec.world_size)]
            self.log.data({"step": step, "generation": gen, "ranges": bounds,
                           "global_samples": m["global_samples"] if m else None})
        self.view.step(entry)
        return bool(self.on_step is not None and m is not None and self.on_step(entry) is True)

    def ingest(self, workers: Sequence[Any], batches: Sequence[Sequence[dict[str, Any]]],
               spec: StrategySpec | None, generation: int,
               on_metric: Callable[[dict[str, Any], StrategySpec | None], None]) -> bool:
        """The metrics each worker drained: update its info (speed, share), pass every
        metric to ``on_metric`` (checkpoint notices), and record each completed step once
        (rank 0's metrics). Returns True when ``on_step`` asked to stop."""
        per_step: dict[int, dict[str, Any]] = {}
        for w, batch in zip(workers, batches, strict=True):
            for m in batch:
                w.info["samples_per_s"] = m["samples"] / m["step_time"] if m["step_time"] else 0
                w.info["share"] = m["samples"]
                if m["step"] not in per_step or m["rank"] == 0:
                    per_step[m["step"]] = m
                on_metric(m, spec)
        self.fresh = bool(per_step)
        stop = False
        for step in sorted(per_step):
            assert spec is not None
            stop = self.record(step, per_step[step], spec, generation) or stop
        return stop

    def truncate(self, step: int) -> None:
        """Forget steps from ``step`` on: they will run again (a restore to ``step``)."""
        self.history = [h for h in self.history if h["step"] < step]
