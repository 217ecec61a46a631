"""A running trial's side of the pruner: the job's ``StepHook`` (``on_step``, ``watch_at``,
``pause_after``, ``gate``).

``TrialSteps`` takes each completed step's loss, asks the pruner at the steps where it can
decide (``pruning.PruneSteps``) and, on "prune", returns True: the controller posts a stop,
which reaches the workers at once (they stop at their next step boundary). By default the
workers do not wait: the controller polls so that each decision step's metrics arrive
about when the step ends (``watch_at``), and the stop reaches the workers within a step of
the decision; they may have trained a few steps past the decided step by then (the
driver's lag: docs/sweeps.md). With ``exact`` the job pauses after each decision step
(``pause_after``), so no step runs past it, at the cost of a pause per decision step.
Under the median pruner, successive halving and Hyperband, the decision itself reaches the
workers ahead (``gate``, from ``elastic.sweep.gates``): they stop at the decision step's end
when the pruner would prune there, and the step's entry says so (``gate: prune``); the
driver records that decision.

Only what the pruner reads is reported while the trial runs: each decision step's value,
and before it the best value of the steps since the last decision (the median pruner
compares a trial's best value so far); the other steps' values are reported by ``finish``
when the job ends, so the study's curves are whole and a finished trial's ``last_step``
(which Hyperband's ``max_resource: auto`` reads) is its real one.

When Hyperband promotes the trial and the
sweep has ``promotion``, asks the job to grow (``clusters.sweep_policy.PromotionPolicy``)
through ``post`` (the job's in-place ``scale`` request, at that same boundary). The step it
was pruned at and its promotions go into the trial's user attributes as they happen, so
the sweep reads them from the storage whichever process ran the job.

``ScheduledHook`` is the same for a trial that runs in an elastic scheduler's process: it
is pickled there with the job, and the scheduler opens the study from its storage URL when
the trial is queued (``open_soon``), so the trial's first steps never wait on the storage.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.study import StudyDirection

from clusters.sweep_policy import Grow, PromotionObservation, PromotionPolicy, PruneGate

from ..control.hooks import StepHook
from .gates import HALVING_LOCK, REFRESH_S, best_of, gate_for, halving_gate, percentile_of
from .pruning import PruneSteps

__all__ = ["TrialSteps", "ScheduledHook", "GATE_SPAN"]

GATE_SPAN = 1024  # steps a gate's "through" may lag the driver's before it is sent anew


class TrialSteps(StepHook):
    """``on_step`` of one trial's job. ``post(kind, value, reason)`` reaches the job's
    controller (None: no growth); ``sizes`` = (start, min, max) workers of the job."""

    refresh_s = REFRESH_S  # a gate's threshold is read from the study again after this long

    def __init__(self, trial: optuna.Trial, steps: PruneSteps,
                 promotion: PromotionPolicy | None = None,
                 sizes: tuple[int, int, int] = (1, 1, 1),
                 post: Callable[[str, Any, str], None] | None = None,
                 exact: bool = False) -> None:
        self.trial = trial
        self.steps = steps
        self.exact = exact
        self.pending: dict[int, float] = {}  # seen, not reported yet
        self._maximize = trial.study.direction == StudyDirection.MAXIMIZE  # (a storage read)
        self.best: float | None = None  # the best value seen (best_of), None before any
        self.through = -1  # the newest step seen
        self._gate: PruneGate | None = None  # the last gate handed out
        self._gate_step: int | None = None  # the decision step it was read for
        self._gate_at = 0.0  # time.monotonic() of that read
        self._versions = 0  # gates handed out
        pruner = trial.study.pruner
        self._halving = (steps.kind == "hyperband" and isinstance(
            pruner, optuna.pruners.HyperbandPruner | optuna.pruners.SuccessiveHalvingPruner))
        self._gates = not exact and not steps.every and (
            self._halving or (steps.kind == "median" and percentile_of(pruner) is not None))
        self.decided_time: float | None = None  # time.time() of the decision to prune
        self.promotion = promotion
        self.sizes = sizes
        self.post = post
        self.reported: set[int] = set()
        self.pruned_at: int | None = None
        self.promoted: list[list[int]] = []  # [step, rung, workers asked]

    def pause_after(self, step: int) -> int | None:
        """The job's pause steps: the decision steps in exact mode, else none."""
        return self.watch_at(step) if self.exact else None

    def watch_at(self, step: int) -> int | None:
        """The first decision step >= ``step``: its metrics are wanted as soon as they exist."""
        return self.steps.next_at(step)

    def gate(self, next_step: int) -> PruneGate | None:
        """The workers' gate for the first decision step >= ``next_step`` (None: the
        driver decides alone). Its threshold is read again after ``refresh_s``; a gate
        whose threshold did not change is handed out unchanged (same version), unless the
        driver has ``GATE_SPAN`` more steps than it says (the workers keep the last
        2,048-4,096 losses: a long interval's gate would otherwise need older ones)."""
        if not self._gates or self.pruned_at is not None:
            return None
        step = self.steps.next_at(next_step)
        if step is None:
            return None
        g, now = self._gate, time.monotonic()
        if self._gate_step == step and now - self._gate_at < self.refresh_s:
            return g  # (None too: the study is read at most every refresh_s)
        self._gate_step, self._gate_at = step, now
        version = self._versions + 1
        new = (halving_gate(self.trial.study, self.trial._trial_id,  # noqa: SLF001
                            self.trial.number, step, version) if self._halving
               else gate_for(self.trial.study, step, self.best, self.through, version))
        if (new is not None and g is not None and g.step == step
                and _same(new.threshold, g.threshold) and new.through - g.through < GATE_SPAN):
            return g
        self._versions += new is not None
        self._gate = new
        return new

    def on_step(self, entry: dict[str, Any]) -> bool:
        """Take ``entry``'s loss; True (stop the job now) when the pruner says so (or the
        workers did, through the gate)."""
        if self.pruned_at is not None:
            return True
        step = int(entry["step"])
        if step in self.reported or step in self.pending:  # re-run after a recovery
            return False
        loss = float(entry["loss"])
        self.best = best_of([loss] if self.best is None else [self.best, loss], self._maximize)
        self.through = max(self.through, step)
        if not self.steps.decides_at(step):
            self.pending[step] = float(entry["loss"])
            return False  # the pruner answers "go on" here whatever the values
        self._report_best()
        self._report(step, float(entry["loss"]))
        gated = entry.get("gate") == "prune"
        # successive halving's should_prune writes the trial's rung value, which the trials
        # after it compete with: asked even when the gate has already stopped the workers
        if self._halving:
            with HALVING_LOCK:  # the pruner may set itself up in place (gates.HALVING_LOCK)
                said = self.trial.should_prune()
        else:
            said = self.trial.should_prune() if not gated else True
        if gated or said:
            self.decided_time = float(entry.get("gate_time") or time.time())
            self.pruned_at = step
            self.trial.set_user_attr("pruned_at_step", step)
            self.trial.set_user_attr("pruned_at_time", self.decided_time)
            return True
        if self.promotion is not None and self.post is not None:
            self._promote(step, int(entry["world_size"]))
        return False

    def finish(self) -> None:
        """Report the values not reported yet (the steps before a prune decision, or all of
        a trial that ran to its end): the study holds every step the trial kept."""
        for step in sorted(self.pending):
            if self.pruned_at is None or step < self.pruned_at:
                self._report(step, self.pending[step])
        self.pending.clear()

    def _report(self, step: int, value: float) -> None:
        self.reported.add(step)
        self.pending.pop(step, None)
        self.trial.report(value, step)

    def _report_best(self) -> None:
        """Report the best pending value (in the study's direction; NaN never best): the
        pruner's "best so far" of the trial is then what it would be had every step been
        reported, and a decision step stays the newest reported step."""
        finite = {s: v for s, v in self.pending.items() if math.isfinite(v)}
        if not finite:
            return
        pick = max if self._maximize else min
        best = pick(finite, key=lambda s: finite[s])
        self._report(best, finite[best])

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


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class ScheduledHook(StepHook):
    """``on_step``/``pause_after`` of a trial whose job an elastic scheduler runs: pickled
    into the scheduler's process with the job, it opens the study there (the storage must
    be reachable from the scheduler's node: a database server, or SQLite on that host).
    Growth on promotion is the scheduler's to decide, not the trial's."""

    def __init__(self, storage_url: str, study_name: str, trial_id: int,
                 pruner: optuna.pruners.BasePruner, steps: PruneSteps,
                 exact: bool = False) -> None:
        self.storage_url = storage_url
        self.exact = exact
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

    def pause_after(self, step: int) -> int | None:
        return self.watch_at(step) if self.exact else None

    def watch_at(self, step: int) -> int | None:
        return self.steps.next_at(step)

    def finish(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.finish()

    def open(self) -> TrialSteps:
        """The trial's ``TrialSteps`` over the study opened from its storage (once)."""
        with self._lock:
            if self._live is None:
                engine: dict[str, Any] = ({"connect_args": {"timeout": 60}}
                                          if self.storage_url.startswith("sqlite") else {})
                study = optuna.load_study(
                    study_name=self.study_name, pruner=self.pruner,
                    storage=optuna.storages.RDBStorage(self.storage_url, engine_kwargs=engine),
                    sampler=optuna.samplers.RandomSampler())
                # what the first decision reads (every trial's values), once ahead: a cold
                # storage made that decision 40-60 ms instead of ~13
                study.get_trials(deepcopy=False)
                self._live = TrialSteps(optuna.trial.Trial(study, self.trial_id), self.steps,
                                        exact=self.exact)
            return self._live

    def open_soon(self) -> threading.Thread:
        """Open the study in a background thread, while the trial waits in the queue and its
        workers start (opening takes 0.1-1 s: a trial of short steps could otherwise train to
        its end before its first decision). An error there is raised again by ``on_step``,
        which opens it itself."""
        def run() -> None:
            try:
                self.open()
            except Exception:  # noqa: BLE001, S110 - on_step opens it again and raises
                pass

        t = threading.Thread(target=run, name=f"elastic-study-{self.trial_id}", daemon=True)
        t.start()
        return t

    def on_step(self, entry: dict[str, Any]) -> bool:
        live = self.open()
        with self._lock:
            return live.on_step(entry)

    def gate(self, next_step: int) -> PruneGate | None:
        """Never waits for the study to open (the controller asks before a segment)."""
        with self._lock:
            live = self._live
            return None if live is None else live.gate(next_step)
