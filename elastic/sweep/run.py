"""Running a sweep: load and check it, open the study, run the missing trials on the cluster.

``load_sweep`` is every check that runs before Ray starts (the file, each edge of the search
space as a job, each searched factory built once, the sampler and the pruner); ``run_sweep``
then opens (or resumes) the study and lets Optuna run the trials that the study still lacks,
as many at once as the cluster holds. ``cli`` is ``elastic sweep FILE``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, TextIO

import optuna

from ..config import JobConfig
from .cluster import concurrency, connect, disconnect
from .factories import check_factories
from .report import format_summary
from .runner import TrialRunner, optimize_trials
from .study import FINISHED, make_pruner, make_sampler, open_study, trial_counts
from .sweep_file import SweepConfig

__all__ = ["load_sweep", "check_sweep", "run_sweep", "optimize", "cli"]


def check_sweep(cfg: SweepConfig) -> None:
    """Every check of a sweep that needs neither Ray nor the storage (``ConfigError``): the
    file and its jobs (``SweepConfig.validate``), Optuna's sampler and pruner, and each
    searched factory built once (``factories.check_factories``)."""
    cfg.validate()
    make_sampler(cfg)
    make_pruner(cfg)
    check_factories(cfg)


def load_sweep(source: SweepConfig | dict[str, Any] | str) -> SweepConfig:
    """A checked SweepConfig (``check_sweep``) from a sweep file path, a dict of its
    contents, or itself."""
    if isinstance(source, SweepConfig):
        cfg = source
    elif isinstance(source, str):
        cfg = SweepConfig.from_yaml(source)
    else:
        cfg = SweepConfig.from_dict(source)
    check_sweep(cfg)
    return cfg


def run_sweep(config: SweepConfig | dict[str, Any] | str, *, n_trials: int | None = None,
              out: TextIO | None = None, scheduler: str | None = None) -> optuna.Study:
    """Run (or resume) a sweep until ``n_trials`` trials of its study have finished
    (complete or pruned) and return the study.

    ``config`` is a sweep file path, a dict of its contents or a SweepConfig; ``n_trials``
    overrides the file's. Progress lines go to ``out`` if given. ``scheduler`` (or the
    file's ``scheduler:``) queues each trial in that running elastic scheduler, which
    shares its workers among the trials and its other jobs under its policy. Raises ``ConfigError`` for a
    bad sweep (before any trial starts), ``ClusterError`` when Ray cannot host one trial.
    Errors inside a trial fail that trial only; the sweep goes on.
    """
    cfg = load_sweep(config)
    if n_trials is not None or scheduler is not None:
        cfg = dataclasses.replace(cfg, n_trials=n_trials or cfg.n_trials,
                                  scheduler=scheduler or cfg.scheduler)
        cfg.validate()
    probes = cfg.probe_configs()
    if cfg.storage is None:
        os.makedirs(cfg.run_path, exist_ok=True)
    study = open_study(cfg)
    runner = TrialRunner(cfg, out)
    done = sum(trial_counts(study)[s.name.lower()] for s in FINISHED)
    remaining = cfg.n_trials - done
    if remaining <= 0:
        runner.say(f"study {cfg.study_name}: {done} trials already finished (n_trials "
                   f"{cfg.n_trials}); nothing to run")
        return study
    started = connect(probes, runner.say)
    own = False  # a pool made here, closed here
    try:
        n_jobs, why = concurrency(cfg, probes) if cfg.scheduler is None else \
            (_queued(cfg, probes), "")
        if cfg.scheduler is None:  # a trial's workers go back warm, for the next trial:
            # to this process's default pool when it has one (its idle workers would
            # otherwise hold the resources the trials need), else to a pool of the sweep's
            from ..control.pool import default_pool

            runner.pool = default_pool()
            if runner.pool is None:
                runner.pool, own = _pool(probes, n_jobs), True
        where = (f"{n_jobs} at a time{why}" if cfg.scheduler is None else
                 f"up to {n_jobs} queued at a time in scheduler {cfg.scheduler!r}")
        runner.say(f"study {cfg.study_name} in {cfg.storage_shown}: {done} finished, "
                   f"running {remaining} more, {where}; trial runs under {cfg.run_path}")
        optimize_trials(
            study, runner, n_trials=remaining, n_jobs=n_jobs, timeout=cfg.timeout_s,
            gc_after_trial=False, show_progress_bar=False,
            callbacks=[optuna.study.MaxTrialsCallback(cfg.n_trials, states=FINISHED),
                       runner.after_trial])
    finally:
        runner.release()
        if own:
            runner.pool.close()
        disconnect(started)
    return study


def _pool(probes: list[JobConfig], n_jobs: int) -> Any:
    """A pool that starts nothing ahead: the first trials start their workers, which then
    serve the following trials (docs/scheduler.md, "Warm workers"); it keeps idle at most
    what the concurrent trials can use at once."""
    from ..control.pool import WorkerPool

    p = probes[0]
    return WorkerPool(0, resources_per_worker=dict(p.resources_per_worker),
                      use_gpu=p.use_gpu, max_idle=n_jobs * max(c.max_world for c in probes),
                      wait=False)


def _queued(cfg: SweepConfig, probes: list[JobConfig]) -> int:
    """Trials in a scheduler's queue at once: ``max_concurrent``, else as many as its
    workers hold at the trials' smallest size (the scheduler admits and sizes them)."""
    from ..scheduler import info

    capacity = int(info(str(cfg.scheduler))["workers"])
    smallest = min(c.min_world for c in probes)
    return max(1, cfg.max_concurrent or capacity // max(1, smallest))


def optimize(base: JobConfig | dict[str, Any], params: dict[str, Any], n_trials: int, *,
             study_name: str = "sweep", storage: str | None = None, direction: str = "minimize",
             sampler: str | dict[str, Any] = "tpe", pruner: str | dict[str, Any] = "median",
             max_concurrent: int | None = None, objective: Any = "final_loss",
             run_dir: str | None = None, out: TextIO | None = None,
             scheduler: str | None = None) -> optuna.Study:
    """The SDK form of a sweep file: ``base`` may hold Python objects (callables, datasets)."""
    return run_sweep({
        "study": {"name": study_name, "storage": storage, "direction": direction,
                  "sampler": sampler, "pruner": pruner},
        "base": base, "params": params, "n_trials": n_trials, "max_concurrent": max_concurrent,
        "objective": objective, "run_dir": run_dir}, out=out, scheduler=scheduler)


def cli(path: str, n_trials: int | None = None, scheduler: str | None = None) -> int:
    """``elastic sweep FILE [--scheduler NAME]``: run the sweep, print progress and the
    summary; 1 if no trial completed."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = run_sweep(path, n_trials=n_trials, out=sys.stdout, scheduler=scheduler)
    print(format_summary(study))
    return 0 if trial_counts(study)["complete"] else 1
