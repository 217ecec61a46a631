"""The trial runner: each Optuna trial runs the base job with its sampled values, as a job.

``TrialRunner.objective`` is the objective Optuna calls, in one thread per concurrent trial:
it asks the trial for its values and runs the trial's job (a ``Controller``, as
``elastic.fit`` does) with an ``on_step`` hook (``trial_steps.TrialSteps``) that asks the
pruner at each step where it can decide (``pruning.PruneSteps``) as soon as that step's
loss arrives; a "prune" stops the workers within a step of the decision, and they are
released at once. With ``pruning: {exact: true}`` the job pauses after those steps, so no
step runs past the decision. A trial that Hyperband promotes is grown by
``clusters.sweep_policy.PromotionPolicy`` (``promotion: {growth: g}``) through the job's
in-place ``scale`` request at that same boundary. What the job ran as goes into the trial's
user attributes; ``after_trial`` prints one line per finished trial. No Ray here: the
controller reaches the cluster.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any, TextIO

import optuna

from clusters.sweep_policy import PromotionPolicy

from ..config import JobConfig
from ..errors import ElasticError, InterruptedJobError
from .pruning import PruneSteps, prune_lag
from .report import trial_line
from .sweep_file import SweepConfig
from .trial_steps import ScheduledHook, TrialSteps

if TYPE_CHECKING:
    from ..control import FitResult

__all__ = ["TrialRunner", "SweepInterrupted", "optimize_trials"]


# what a trial's run says of its outcome (a retry starts without the stale trial's)
_OUTCOME = ("pruned_at_step", "pruned_at_time", "prune_lag", "error")


class SweepInterrupted(Exception):
    """A trial's job stopped by a signal (Ctrl-C, SIGTERM): not a failure of that trial that
    the sweep goes on from (Optuna's ``catch`` takes every ``ElasticError``), but the sweep's
    end; ``error`` is the job's ``InterruptedJobError``."""

    def __init__(self, error: InterruptedJobError) -> None:
        super().__init__(str(error))
        self.error = error


def optimize_trials(study: optuna.Study, runner: TrialRunner, **kw: Any) -> None:
    """``study.optimize`` over ``runner.objective``: a trial's ``ElasticError`` fails that
    trial only; a signal ends the sweep with the job's ``InterruptedJobError`` (its exit
    code). Was: that trial failed and the next ones ran to the end, exit 0 (found by a new
    user, session 48)."""
    try:
        study.optimize(runner.objective, catch=(ElasticError,), **kw)
    except SweepInterrupted as e:
        raise e.error from None


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
        self.pool: Any = None  # an elastic.WorkerPool the trials' jobs share (run_sweep's)
        self._data: tuple[Any, dict[str, Any]] | None = None  # (key, blocks): the last run
        self._data_lock = threading.Lock()

    def say(self, line: str) -> None:
        if self.out is not None:
            with self._lock:
                print(f"[sweep] {line}", file=self.out, flush=True)

    def objective(self, trial: optuna.Trial) -> float:
        """Run trial ``trial`` as a job and return its value. ``optuna.TrialPruned`` when the
        pruner stopped it; an ``ElasticError`` of the job, or of the objective on its result,
        fails the trial (its first line is the trial's ``error`` attribute)."""
        cfg = self.cfg
        sys_attrs = trial.storage.get_trial_system_attrs(trial._trial_id)  # noqa: SLF001
        if sys_attrs.get("failed_trial") is not None:
            # a retry of a trial whose process died: Optuna copied its user attributes, and a
            # prune decided for it would mark this run pruned at its end
            for key in _OUTCOME:
                if trial.user_attrs.get(key) is not None:
                    trial.set_user_attr(key, None)
        values = {name: p.suggest(trial) for name, p in cfg.params.items()}
        fields = cfg.trial_fields(trial.number, values)
        trial.set_user_attr("run_dir", fields["run_dir"])
        trial.set_user_attr("job", fields["name"])
        t0 = time.monotonic()
        try:
            job = JobConfig.from_dict(fields)
            result = (self._scheduled(trial, job) if cfg.scheduler is not None
                      else self._run(trial, job))
        except InterruptedJobError as e:
            self._failed(trial, e, t0)
            raise SweepInterrupted(e) from e
        except ElasticError as e:
            self._failed(trial, e, t0)
            raise
        last = result.history[-1] if result.history else {}
        finite = [h["loss"] for h in result.history if math.isfinite(h["loss"])]
        for key, val in (("world_size", last.get("world_size")), ("strategy", last.get("strategy")),
                         ("steps", len(result.history)), ("final_loss", last.get("loss")),
                         ("min_loss", min(finite) if finite else None),
                         ("seconds", round(time.monotonic() - t0, 2))):
            trial.set_user_attr(key, val)
        attrs = trial.storage.get_trial_user_attrs(trial._trial_id)  # noqa: SLF001
        pruned_at = attrs.get("pruned_at_step")
        if pruned_at is not None and attrs.get("pruned_at_time") is not None:
            trial.set_user_attr("prune_lag", prune_lag(result.history, int(pruned_at),
                                                       float(attrs["pruned_at_time"])))
        if pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {pruned_at}")
        try:
            return self._value(result)
        except ElasticError as e:
            self._failed(trial, e, t0)
            raise

    def _value(self, result: FitResult) -> float:
        """The objective's value of ``result``; ``ElasticError`` naming the objective when it
        raises or gives no number, which fails this trial only (was: the error left
        ``study.optimize``, whose ``catch`` holds only ElasticError, and ended the sweep)."""
        obj = self.cfg.objective
        what = f"objective {obj if isinstance(obj, str) else getattr(obj, '__qualname__', obj)!r}"
        try:
            value = self.value(result)
        except Exception as e:
            raise ElasticError(f"{what} raised {type(e).__name__}: {e}. Fix: make it return "
                               "a number for the trial's FitResult") from e
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ElasticError(f"{what} returned {value!r}, not a number. Fix: make it "
                               "return a number (float) for the trial's FitResult") from None

    @staticmethod
    def _failed(trial: optuna.Trial, e: ElasticError, t0: float) -> None:
        """Record why the trial failed (its first line) and how long it ran."""
        trial.set_user_attr("error", f"{type(e).__name__}: {str(e).splitlines()[0]}"[:1000])
        trial.set_user_attr("seconds", round(time.monotonic() - t0, 2))

    def _shared_data(self, job: JobConfig) -> None:
        """Give ``job`` the blocks of its Ray datasets, run once for every trial that has the
        same pipeline (``ray_dataset.data_key``); the first such trial runs it, the others
        wait for it. A trial whose model or loss fails on the rows fails alone (its job
        checks them), and the run is kept. Only the last pipeline is kept: a sweep over the
        dataset's settings runs each as its trial comes; a running trial keeps its blocks."""
        from ..ray_dataset import data_key, prepare

        key = data_key(job)
        if key is None:
            return
        with self._data_lock:
            if self._data is None or self._data[0] != key:
                self._data = None  # (its blocks go once no trial holds them)
                t0 = time.monotonic()
                blocks = prepare(job, None, None, self.pool)  # each trial checks its model
                self._data = (key, blocks)
                if blocks:  # (a factory that gave a map-style dataset: each trial's own)
                    self.say("ran the Ray dataset once for the trials: " + ", ".join(
                        f"{f} {len(b)} rows in {len(b.refs)} blocks"
                        for f, b in blocks.items()) + f" ({time.monotonic() - t0:.1f}s)")
            job.ray_blocks = dict(self._data[1])

    def release(self) -> None:
        """Let go of the sweep's Ray dataset blocks (its end)."""
        with self._data_lock:
            self._data = None

    def _run(self, trial: optuna.Trial, job: JobConfig) -> FitResult:
        """The trial's job in this process: a controller whose ``on_step`` is the trial's."""
        from ..control import Controller, Request
        from ..view import make_view

        self._shared_data(job)

        ctl: list[Controller] = []
        hook = TrialSteps(trial, self.prune_steps, self.promotion,
                          (job.num_workers, job.min_world, job.max_world),
                          lambda kind, value, why: ctl[0].post(Request(kind, value, why)),
                          exact=self.cfg.exact_pruning)
        ctl.append(Controller(job, make_view(job.view, job.log_every), hook=hook,
                              pool=self.pool))
        try:
            return ctl[0].run()
        finally:
            hook.finish()

    def _scheduled(self, trial: optuna.Trial, job: JobConfig) -> FitResult:
        """The trial's job queued in the elastic scheduler ``cfg.scheduler``: it starts when
        the scheduler's policy admits it and runs at the size it decides; the pruner's hook
        runs beside its controller in the scheduler's process."""
        from ..control import FitResult
        from ..scheduler import submit_to

        assert self.cfg.scheduler is not None
        hook = ScheduledHook(self.cfg.storage_url, self.cfg.study_name,
                             trial._trial_id, trial.study.pruner,  # noqa: SLF001
                             self.prune_steps, self.cfg.exact_pruning)
        out = submit_to(self.cfg.scheduler, job, hook=hook).result()
        if out["state"] != "finished":
            raise ElasticError(f"the scheduler's job {job.job_name!r} ended {out['state']}: "
                               f"{out.get('error') or 'cancelled'}")
        if not out.get("history"):  # ended before a restart of its scheduler: kept as a row
            raise ElasticError(f"the scheduler's job {job.job_name!r} finished before its "
                               "scheduler restarted, which keeps no job's results: the "
                               "trial's value is lost (its run directory has its metrics)")
        if out.get("history_dropped"):  # the scheduler let it go (``HISTORY_KEPT``)
            raise ElasticError(f"the scheduler's job {job.job_name!r}: {out['note']}; the "
                               "trial's value is not computed from one step")
        if out.get("params_taken"):  # read before (they are handed out once)
            raise ElasticError(f"the scheduler's job {job.job_name!r}: {out['note']}")
        final = {f"model/{k}": v for k, v in (out.get("state_dict") or {}).items()}
        return FitResult(final, list(out.get("history") or []), [], out.get("run_dir") or "")

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.say(trial_line(trial))
