"""The trial runner: each Optuna trial runs the base job with its sampled values, as a job.

``TrialRunner.objective`` is the objective Optuna calls, in one thread per concurrent trial:
it asks the trial for its values, runs ``elastic.fit`` on the trial's job with an ``on_step``
hook that reports each step's loss and stops the job at the next step boundary when the
pruner says so, and records what the job ran as in the trial's user attributes.
``after_trial`` prints one line per finished trial. No Ray here: ``fit`` reaches the cluster.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, TextIO

import optuna

from ..errors import ElasticError
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
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        if self.out is not None:
            with self._lock:
                print(f"[sweep] {line}", file=self.out, flush=True)

    def objective(self, trial: optuna.Trial) -> float:
        """Run trial ``trial`` as a job and return its value. ``optuna.TrialPruned`` when the
        pruner stopped it; an ``ElasticError`` of the job fails the trial (its first line is
        the trial's ``error`` attribute)."""
        from ..api import fit

        cfg = self.cfg
        values = {name: p.suggest(trial) for name, p in cfg.params.items()}
        fields = cfg.trial_fields(trial.number, values)
        trial.set_user_attr("run_dir", fields["run_dir"])
        trial.set_user_attr("job", fields["name"])
        reported: set[int] = set()
        pruned_at: list[int] = []

        def on_step(entry: dict[str, Any]) -> bool:
            if pruned_at:
                return True
            step = int(entry["step"])
            if step in reported:  # re-run after a recovery from an older state
                return False
            reported.add(step)
            trial.report(float(entry["loss"]), step)
            if trial.should_prune():
                pruned_at.append(step)
                return True
            return False

        t0 = time.monotonic()
        try:
            result = fit(fields, on_step=on_step)
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
        if pruned_at:
            trial.set_user_attr("pruned_at_step", pruned_at[0])
            raise optuna.TrialPruned(f"pruned at step {pruned_at[0]}")
        return float(self.value(result))

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.say(trial_line(trial))
