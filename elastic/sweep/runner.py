"""The trial runner: each Optuna trial runs the base job with its sampled values, as a job.

``TrialRunner.objective`` is the objective Optuna calls, in one thread per concurrent trial:
it asks the trial for its values and runs the trial's job (a ``Controller``, as
``elastic.fit`` does) with an ``on_step`` hook that reports each step's loss. The job pauses
after each step at which the pruner can decide (``pruning.PruneSteps``): the hook asks the
pruner there, with the workers waiting, so a pruned trial trains no step past the decision
and its workers are released at once. A trial that Hyperband promotes is grown by
``clusters.sweep_policy.PromotionPolicy`` (``promotion: {growth: g}``) through the job's
in-place ``scale`` request at that same boundary. What the job ran as goes into the trial's
user attributes; ``after_trial`` prints one line per finished trial. No Ray here: the
controller reaches the cluster.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, TextIO

import optuna

from clusters.sweep_policy import Grow, PromotionObservation, PromotionPolicy

from ..config import JobConfig
from ..errors import ElasticError
from .pruning import PruneSteps
from .report import trial_line
from .sweep_file import SweepConfig

__all__ = ["TrialRunner"]


class TrialRunner:
    """Runs the trials of one sweep invocation. Trial threads share it; ``_lock`` guards
    the output."""

    def __init__(self, cfg: SweepConfig, out: TextIO | None) -> None:
        self.cfg = cfg
        self.out = out
        self.value = cfg.objective_fn()
        self.prune_steps = PruneSteps.of(cfg.pruner)
        self.promotion = PromotionPolicy(cfg.promotion) if cfg.promotion is not None else None
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        if self.out is not None:
            with self._lock:
                print(f"[sweep] {line}", file=self.out, flush=True)

    def objective(self, trial: optuna.Trial) -> float:
        """Run trial ``trial`` as a job and return its value. ``optuna.TrialPruned`` when the
        pruner stopped it; an ``ElasticError`` of the job fails the trial (its first line is
        the trial's ``error`` attribute)."""
        from ..control import Controller, Request
        from ..view import make_view

        cfg = self.cfg
        values = {name: p.suggest(trial) for name, p in cfg.params.items()}
        fields = cfg.trial_fields(trial.number, values)
        trial.set_user_attr("run_dir", fields["run_dir"])
        trial.set_user_attr("job", fields["name"])
        reported: set[int] = set()
        pruned_at: list[int] = []
        promoted: list[list[int]] = []  # [step, rung, workers asked]
        steps = self.prune_steps
        t0 = time.monotonic()
        try:
            job = JobConfig.from_dict(fields)
            ctl: Controller | None = None

            def on_step(entry: dict[str, Any]) -> bool:
                if pruned_at:
                    return True
                step = int(entry["step"])
                if step in reported:  # re-run after a recovery from an older state
                    return False
                reported.add(step)
                trial.report(float(entry["loss"]), step)
                if not steps.decides_at(step):
                    return False  # the pruner answers "go on" here whatever the values
                if trial.should_prune():
                    pruned_at.append(step)
                    return True
                if self.promotion is not None and ctl is not None:
                    grow = self._promotion(trial, job, entry, promoted)
                    if grow is not None:
                        promoted.append([step, grow[0], grow[1].n])
                        ctl.post(Request("scale", grow[1].n, reason=grow[1].reason))
                return False

            ctl = Controller(job, make_view(job.view, job.log_every), on_step=on_step,
                             pause_after=None if steps.kind == "none" else steps.next_at)
            result = ctl.run()
        except ElasticError as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {str(e).splitlines()[0]}"[:1000])
            trial.set_user_attr("seconds", round(time.monotonic() - t0, 2))
            raise
        last = result.history[-1] if result.history else {}
        finite = [h["loss"] for h in result.history if math.isfinite(h["loss"])]
        for key, val in (("world_size", last.get("world_size")), ("strategy", last.get("strategy")),
                         ("steps", len(result.history)), ("final_loss", last.get("loss")),
                         ("min_loss", min(finite) if finite else None),
                         ("seconds", round(time.monotonic() - t0, 2))):
            trial.set_user_attr(key, val)
        if promoted:
            trial.set_user_attr("promotions", promoted)
        if pruned_at:
            trial.set_user_attr("pruned_at_step", pruned_at[0])
            raise optuna.TrialPruned(f"pruned at step {pruned_at[0]}")
        return float(self.value(result))

    def _promotion(self, trial: optuna.Trial, job: JobConfig, entry: dict[str, Any],
                   promoted: list[list[int]]) -> tuple[int, Grow] | None:
        """After a decision step that did not prune: the rungs the trial has passed (the
        pruner's ``completed_rung_<k>`` marks), and the growth the policy asks for when that
        is a new promotion."""
        assert self.promotion is not None
        attrs = trial.storage.get_trial_system_attrs(trial._trial_id)  # noqa: SLF001 - no public read
        rung = sum(1 for k in attrs if k.startswith("completed_rung_"))
        if rung == 0 or (promoted and promoted[-1][1] >= rung):
            return None
        d = self.promotion.decide(PromotionObservation(
            rung, int(entry["world_size"]), job.num_workers, job.min_world, job.max_world))
        return (rung, d) if isinstance(d, Grow) else None

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.say(trial_line(trial))
