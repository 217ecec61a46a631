"""Sweep pruning benchmark: what a pruned trial trains past the pruner's decision, and what
watching for the decision costs a trial that is not pruned, side by side in one run.

Three modes over the same study settings (median pruner, ``n_startup_trials: 1``,
``--warmup`` steps, each of ``--intervals``; or with ``--pruner hyperband``, Hyperband with
``min_resource`` = ``--warmup`` and ``--reduction-factor``, in a study whose name puts both
trials in its first bracket), the same two trials (Adam lr 0.05, which completes, then lr
1e-5, which the pruner stops), on one local Ray, each study in its own SQLite file:

* ``no hook``: the trial's job runs with no pruner hook at all (the baseline: what a job
  costs alone; nothing is pruned, so the second trial runs to its end);
* ``default``: ``elastic sweep``'s default: the workers never wait for the pruner; the
  controller polls when a decision step should have ended, reports what the pruner reads,
  asks it, and a "prune" stops the workers at once;
* ``exact``: ``pruning: {exact: true}``: the job pauses after each decision step
  (the hook's ``pause_after``) while the driver asks the pruner.

Reported per mode: the step the pruner decided at; the pruned trial's steps past it
(``past step``: the driver's lag plus the stop's), begun after the decision was made
(``begun after``: the stop's lag, <= 1 when it reached the workers within a step) and ended
after it; the complete trial's ms per step (from its first step's end to its last: the
watching's cost) and its ratio to ``no hook``. ``--loss`` picks the step's cost: ``mse`` is
a ~2 ms step, ``tests.integration.test_sweep_live:slow_mse`` ~22 ms. A benchmark, not a
test. From the repository root: ``python bench/sweep_prune.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trial(study: Any, lr: float, a: Any, run_dir: str, mode: str, prune_steps: Any
           ) -> dict[str, Any]:
    import optuna

    from elastic.config import JobConfig
    from elastic.control import Controller
    from elastic.sweep.pruning import prune_lag
    from elastic.sweep.trial_steps import TrialSteps
    from elastic.view import View

    trial = study.ask()
    hook = TrialSteps(trial, prune_steps, exact=mode == "exact")
    job = JobConfig.from_dict(dict(
        model="tests.helpers:mlp", optimizer={"name": "adam", "lr": lr}, loss=a.loss,
        dataset="tests.helpers:RegressionData", global_batch_size=8, max_steps=a.steps,
        num_workers=1, view="none", name=f"bench-{trial.number}-{mode}", run_dir=run_dir))
    if mode == "no hook":
        res = Controller(job, View()).run()
    else:
        res = Controller(job, View(), hook=hook).run()
        hook.finish()
    h = res.history
    secs = h[-1]["time"] - h[0]["time"] if len(h) > 1 else 0.0
    out: dict[str, Any] = {"steps": len(h), "pruned_at": hook.pruned_at,
                           "ms": secs / max(1, len(h) - 1) * 1e3}
    if hook.pruned_at is not None:
        assert hook.decided_time is not None
        out["lag"] = prune_lag(h, hook.pruned_at, hook.decided_time)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, res.final_loss)
    return out


def _first_bracket(tag: str, pruner: Any) -> str:
    """A study name (``tag-i``) under which Hyperband puts trials 0 and 1 in bracket 0: the
    second trial then meets the first one's value at the first rung's step, ``--warmup``."""
    import optuna

    from elastic.sweep.gates import halving_of

    for i in range(1000):
        study = optuna.create_study(study_name=f"{tag}-{i}", pruner=pruner)
        found = [halving_of(study, n) for n in (0, 1)]
        if all(f is not None and f[0]._min_early_stopping_rate == 0 for f in found):
            return f"{tag}-{i}"
    raise RuntimeError("no study name puts both trials in the first bracket")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="steps of each trial")
    ap.add_argument("--warmup", type=int, default=20, help="the median pruner's warm-up steps")
    ap.add_argument("--intervals", default="1,10", help="its interval_steps, comma-separated")
    ap.add_argument("--loss", default="mse", help="the job's loss (its cost sets a step's)")
    ap.add_argument("--pruner", choices=("median", "hyperband"), default="median")
    ap.add_argument("--reduction-factor", type=int, default=3, help="Hyperband's")
    a = ap.parse_args()

    import optuna
    import ray

    from elastic.sweep.pruning import PruneSteps

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            hb = a.pruner == "hyperband"
            for interval in ([a.reduction_factor] if hb
                             else [int(x) for x in a.intervals.split(",")]):
                spec: dict[str, Any] = (
                    {"type": "hyperband", "min_resource": a.warmup, "reduction_factor": interval}
                    if hb else {"type": "median", "n_startup_trials": 1,
                                "n_warmup_steps": a.warmup, "interval_steps": interval})
                for mode in ("no hook", "default", "exact"):
                    tag = f"{mode.replace(' ', '-')}-{interval}"
                    pruner = (optuna.pruners.HyperbandPruner(a.warmup, a.steps, interval) if hb
                              else optuna.pruners.MedianPruner(1, a.warmup, interval))
                    study = optuna.create_study(
                        study_name=_first_bracket(tag, pruner) if hb else tag,
                        storage=f"sqlite:///{d}/{tag}.db", pruner=pruner)
                    good = _trial(study, 0.05, a, f"{d}/g-{tag}", mode, PruneSteps.of(spec))
                    bad = _trial(study, 1e-5, a, f"{d}/b-{tag}", mode, PruneSteps.of(spec))
                    rows.append((interval, mode, bad["pruned_at"], bad.get("lag"), good["ms"]))
    finally:
        ray.shutdown()
    print(f"hyperband, min_resource {a.warmup}, reduction factor {a.reduction_factor}"
          if a.pruner == "hyperband" else f"median pruner, warm-up {a.warmup}",
          f"{a.steps} steps per trial; loss {a.loss}", sep="; ")
    print(f"{'rf' if a.pruner == 'hyperband' else 'interval':>8}  {'mode':<8}{'decided at':>11}{'past step':>10}{'begun after':>12}"
          f"{'ended after':>12}{'ms/step':>9}{'ratio':>7}")
    base: dict[int, float] = {}
    for interval, mode, at, lag, ms in rows:
        base.setdefault(interval, ms)
        lag = lag or {}
        print(f"{interval:>8}  {mode:<8}{str(at):>11}{str(lag.get('past_step', '-')):>10}"
              f"{str(lag.get('begun_after', '-')):>12}{str(lag.get('ended_after', '-')):>12}"
              f"{ms:>9.2f}{ms / base[interval] if base[interval] else float('nan'):>7.2f}")
    print(f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    main()
