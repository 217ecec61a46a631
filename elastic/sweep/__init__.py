"""Hyperparameter sweeps: every Optuna trial is an elastic job on part of the Ray cluster.

A sweep file names a study (RDB storage, sampler, pruner), a base job and a search space::

    study: {name: demo, direction: minimize, sampler: tpe, pruner: {type: median}}
    n_trials: 8
    max_concurrent: 2
    base: {model: tests.helpers:mlp, optimizer: {name: adam, lr: 0.01}, ...}
    params:
      optimizer.lr: {type: float, low: 1.0e-4, high: 1.0e-1, log: true}
      strategy: {type: categorical, choices: [dp, zero1]}
    objective: final_loss   # or min_loss, final_eval_loss, min_eval_loss (need eval_dataset),
                            # or 'module:fn' taking the FitResult

Trials run concurrently, one thread each, as many as the cluster holds (or ``max_concurrent``).
Each reports its loss every step; when the pruner says so the job stops at the next step
boundary and frees its workers. The study lives in the RDB storage, so a sweep resumes after its
process dies: finished trials count toward ``n_trials``, trials the dead process left RUNNING
are failed (heartbeat) and retried with the same parameters, and a seeded sampler is re-seeded
so new trials sample new points. See docs/sweeps.md.

The package, by concept (dependencies point down the list):

* ``space``: a search dimension (``Param``) and how a value lands in a job field;
* ``sweep_file``: the sweep file (``SweepConfig``), the job of each trial, probe jobs;
* ``factories``: each searched factory built once, before any trial;
* ``study``: Optuna's sampler, pruner, RDB storage and study (resume);
* ``report``: a trial's line and the summary table;
* ``runner``: the objective (a trial as a job) and its progress lines;
* ``cluster``: attaching to Ray and sizing the concurrency (the one module importing Ray);
* ``run``: ``load_sweep``, ``run_sweep``, ``optimize`` and the ``elastic sweep`` command.
"""

from .report import format_summary, trial_line
from .run import check_sweep, cli, load_sweep, optimize, run_sweep
from .space import Param
from .study import open_study, trial_counts
from .sweep_file import SweepConfig

__all__ = ["Param", "SweepConfig", "load_sweep", "check_sweep", "run_sweep", "optimize",
           "open_study", "trial_counts", "trial_line", "format_summary", "cli"]
