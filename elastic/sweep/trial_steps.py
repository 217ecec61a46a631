"""A running trial's side of the pruner: the job's ``on_step`` and ``pause_after``.

``TrialSteps`` reports each completed step's loss to the trial, asks the pruner at the steps
where it can decide (``pruning.PruneSteps``: the job pauses after those, so the answer
reaches the workers before they train on), and, when Hyperband promotes the trial and the
sweep has ``promotion``, asks the job to grow (``clusters.sweep_policy.PromotionPolicy``)
through ``post`` (the job's in-place ``scale`` request, at that same boundary). The step it
was pruned at and its promotions go into the trial's user attributes as they happen, so
the sweep reads them from the storage whichever process ran the job.

``ScheduledHook`` is the same for a trial that runs in an elastic scheduler's process: it
is pickled there with the job and opens the study from its storage URL on the first step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import optuna

from clusters.sweep_policy import Grow, PromotionObservation, PromotionPolicy

from .pruning import PruneSteps

__all__ = ["TrialSteps", "ScheduledHook"]


class TrialSteps:
    """``on_step`` of one trial's job. ``post(kind, value, reason)`` reaches the job's
    controller (None: no growth); ``sizes`` = (start, min, max) workers of the job."""

    def __init__(self, trial: optuna.Trial, steps: PruneSteps,
                 promotion: PromotionPolicy | None = None,
                 sizes: tuple[int, int, int] = (1, 1, 1),
                 post: Callable[[str, Any, str], None] | None = None) -> None:
        self.trial = trial
        self.steps = steps
        self.promotion = promotion
        self.sizes = sizes
        self.post = post
        self.reported: set[int] = set()
        self.pruned_at: int | None = None
        self.promoted: list[list[int]] = []  # [step, rung, workers asked]

    @property
    def pause_after(self) -> Callable[[int], int | None] | None:
        return None if self.steps.kind == "none" else self.steps.next_at

    def on_step(self, entry: dict[str, Any]) -> bool:
        """Report ``entry``'s loss; True (stop at this boundary) when the pruner says so."""
        if self.pruned_at is not None:
            return True
        step = int(entry["step"])
        if step in self.reported:  # re-run after a recovery from an older state
            return False
        self.reported.add(step)
        self.trial.report(float(entry["loss"]), step)
        if not self.steps.decides_at(step):
            return False  # the pruner answers "go on" here whatever the values
        if self.trial.should_prune():
            self.pruned_at = step
            self.trial.set_user_attr("pruned_at_step", step)
            return True
        if self.promotion is not None and self.post is not None:
            self._promote(step, int(entry["world_size"]))
        return False

    def _promote(self, step: int, workers: int) -> None:
        """After a decision that did not prune: the rungs the trial passed (the pruner's
        ``completed_rung_<k>`` marks); a new promotion may grow the job."""
        assert self.promotion is not None and self.post is not None
        attrs = self.trial.storage.get_trial_system_attrs(self.trial._trial_id)  # noqa: SLF001
        rung = sum(1 for k in attrs if k.startswith("completed_rung_"))
        if rung == 0 or (self.promoted and self.promoted[-1][1] >= rung):
            return
        start, lo, hi = self.sizes
        d = self.promotion.decide(PromotionObservation(rung, workers, start, lo, hi))
        if isinstance(d, Grow):
            self.promoted.append([step, rung, d.n])
            self.trial.set_user_attr("promotions", self.promoted)
            self.post("scale", d.n, d.reason)


class ScheduledHook:
    """``on_step``/``pause_after`` of a trial whose job an elastic scheduler runs: pickled
    into the scheduler's process with the job, it opens the study there (the storage must
    be reachable from the scheduler's node: a database server, or SQLite on that host).
    Growth on promotion is the scheduler's to decide, not the trial's."""

    def __init__(self, storage_url: str, study_name: str, trial_id: int,
                 pruner: optuna.pruners.BasePruner, steps: PruneSteps) -> None:
        self.storage_url = storage_url
        self.study_name = study_name
        self.trial_id = trial_id
        self.pruner = pruner
        self.steps = steps
        self._live: TrialSteps | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_live", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _live=None, _lock=threading.Lock())

    @property
    def pause_after(self) -> Callable[[int], int | None] | None:
        return None if self.steps.kind == "none" else self.steps.next_at

    def on_step(self, entry: dict[str, Any]) -> bool:
        with self._lock:
            if self._live is None:
                engine: dict[str, Any] = ({"connect_args": {"timeout": 60}}
                                          if self.storage_url.startswith("sqlite") else {})
                study = optuna.load_study(
                    study_name=self.study_name, pruner=self.pruner,
                    storage=optuna.storages.RDBStorage(self.storage_url, engine_kwargs=engine),
                    sampler=optuna.samplers.RandomSampler())
                self._live = TrialSteps(optuna.trial.Trial(study, self.trial_id), self.steps)
            return self._live.on_step(entry)
