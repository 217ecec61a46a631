"""Sweep pruning benchmark: a pruned trial's steps past the pruner's decision, and what the
pauses at the decision steps cost a trial that is not pruned, side by side in one run.

Two modes over the same study settings (median pruner, ``n_startup_trials: 1``,
``--warmup`` steps, ``--interval``), the same two trials (Adam lr 0.05, which completes,
then lr 1e-5, which the pruner stops), on one local Ray, each study in its own SQLite file:

* ``no pause``: the trial's job trains whole segments while the driver reports the steps
  it drained and asks the pruner (what sweeps did before);
* ``pause``: the job pauses after each step where the pruner can decide
  (``Controller(pause_after=...)``, what ``elastic sweep`` does now).

Reported per mode: the step the pruner decided at, the steps the pruned trial trained past
it, the complete trial's seconds (from its first step to its end: the pauses' cost) and the
ratio to ``no pause``. A benchmark, not a test. From the repository root:
``python bench/sweep_prune.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trial(study: Any, lr: float, steps: int, run_dir: str, pause: bool, hook_cls: Any,
           prune_steps: Any) -> dict[str, Any]:
    import optuna

    from elastic.config import JobConfig
    from elastic.control import Controller
    from elastic.view import View

    trial = study.ask()
    hook = hook_cls(trial, prune_steps)
    job = JobConfig.from_dict(dict(
        model="tests.helpers:mlp", optimizer={"name": "adam", "lr": lr}, loss="mse",
        dataset="tests.helpers:RegressionData", global_batch_size=8, max_steps=steps,
        num_workers=1, view="none", name=f"bench-{trial.number}-{int(pause)}",
        run_dir=run_dir))
    res = Controller(job, View(), on_step=hook.on_step,
                     pause_after=hook.pause_after if pause else None).run()
    first = res.history[0]["time"] if res.history else time.time()
    secs = res.history[-1]["time"] - first if res.history else 0.0
    if hook.pruned_at is not None:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, res.final_loss)
    return {"steps": len(res.history), "pruned_at": hook.pruned_at, "seconds": secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="steps of each trial")
    ap.add_argument("--warmup", type=int, default=20, help="the median pruner's warm-up steps")
    ap.add_argument("--interval", type=int, default=1, help="its interval_steps")
    a = ap.parse_args()

    import optuna
    import ray

    from elastic.sweep.pruning import PruneSteps
    from elastic.sweep.trial_steps import TrialSteps

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    spec = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": a.warmup,
            "interval_steps": a.interval}
    prune_steps = PruneSteps.of(spec)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            for mode, pause in (("no pause", False), ("pause", True)):
                study = optuna.create_study(
                    study_name=mode.replace(" ", "-"), storage=f"sqlite:///{d}/{int(pause)}.db",
                    pruner=optuna.pruners.MedianPruner(1, a.warmup, a.interval))
                good = _trial(study, 0.05, a.steps, f"{d}/g{int(pause)}", pause, TrialSteps,
                              prune_steps)
                bad = _trial(study, 1e-5, a.steps, f"{d}/b{int(pause)}", pause, TrialSteps,
                             prune_steps)
                past = bad["steps"] - (bad["pruned_at"] + 1) if bad["pruned_at"] is not None \
                    else None
                rows.append((mode, bad["pruned_at"], past, good["seconds"],
                             good["seconds"] / good["steps"] * 1e3))
    finally:
        ray.shutdown()
    base = rows[0][3]
    print(f"median pruner, warm-up {a.warmup}, interval {a.interval}; {a.steps} steps per trial")
    print(f"{'mode':<10}{'decided at':>12}{'steps past':>12}{'complete trial s':>18}"
          f"{'ms/step':>10}{'ratio':>8}")
    for mode, at, past, secs, ms in rows:
        print(f"{mode:<10}{str(at):>12}{str(past):>12}{secs:>18.2f}{ms:>10.2f}"
              f"{secs / base if base else float('nan'):>8.2f}")


if __name__ == "__main__":
    main()
