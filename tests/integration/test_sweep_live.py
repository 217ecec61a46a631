"""Sweeps whose pruner's decisions reach the workers, on a real local Ray with studies in real
SQLite files: a pruned trial's workers stop at the decision step (by default the median
pruner's or Hyperband's decision is handed to them ahead, in a group of one or two) or train
no step past it (``pruning: {exact: true}``), and are gone right after; a trial Hyperband
promotes grows by an in-place scale and still trains its single-process reference's
parameters."""

from __future__ import annotations

import json
import os
import time

import optuna
import pytest
import torch
from optuna.trial import TrialState

from elastic.reference import reference_train
from elastic.sweep import load_sweep, open_study
from elastic.sweep.runner import TrialRunner
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

STEPS = 100
GROWN = 300  # the promoted trial's steps: long enough for a cold second worker to join
FINAL: dict[int, dict[str, torch.Tensor]] = {}  # trial number -> final parameters


def slow_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE that takes 20 ms more: a tiny step is ~1 ms, faster than the controller polls."""
    time.sleep(0.02)
    return torch.nn.functional.mse_loss(out, y)


def keep_final(result) -> float:
    """The objective of the promotion test: the final loss, keeping the parameters."""
    FINAL[int(os.path.basename(result.run_dir).split("-")[-1])] = result.state_dict()
    return float(result.final_loss)


BASE = {"model": "tests.helpers:mlp", "optimizer": {"name": "adam", "lr": 0.01},
        "loss": "tests.integration.test_sweep_live:slow_mse",
        "dataset": "tests.helpers:RegressionData", "global_batch_size": 8, "max_steps": STEPS,
        "num_workers": 1}


def _free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def _metric_steps(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


MEDIAN = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 10, "interval_steps": 5}
# its rungs' steps are 10, 30 and 90; the study's name puts both trials in the first of its
# three brackets (Hyperband draws a trial's bracket from the name and its number), where the
# second trial meets the first one's value at step 10
HYPERBAND = {"type": "hyperband", "min_resource": 10, "reduction_factor": 3}


@pytest.mark.cold_workers  # the workers end with the trial: its CPUs are free after it
@pytest.mark.parametrize("exact, pruner", [(False, MEDIAN), (True, MEDIAN), (False, HYPERBAND)],
                         ids=["default", "exact", "hyperband"])
def test_a_pruned_trial_stops_at_the_decision_and_frees_its_workers(ray_local, tmp_path, exact,
                                                                    pruner):
    ray = ray_local
    total = ray.cluster_resources()["CPU"]
    cfg = load_sweep({
        **({"pruning": {"exact": True}} if exact else {}),
        "study": {"name": "p" if pruner is MEDIAN else "h",
                  "storage": f"sqlite:///{tmp_path}/study.db", "pruner": pruner},
        "base": {**BASE, "num_workers": 1 if exact else 2},
        "params": {"optimizer.lr": {"type": "float", "low": 1.0e-5, "high": 0.1, "log": True}},
        "enqueue": [{"optimizer.lr": 0.05}, {"optimizer.lr": 1.0e-5}],
        "n_trials": 2, "max_concurrent": 1, "run_dir": str(tmp_path / "runs")})
    study = open_study(cfg)
    runner = TrialRunner(cfg, None)
    freed: dict[int, float] = {}

    def after(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        t0 = time.monotonic()  # right after the trial's objective returned
        while _free_cpus(ray) < total and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        freed[trial.number] = time.monotonic() - t0

    study.optimize(runner.objective, n_trials=2, callbacks=[after])
    good, bad = study.get_trials()
    assert good.state == TrialState.COMPLETE and good.user_attrs["steps"] == STEPS
    assert bad.state == TrialState.PRUNED
    at = bad.user_attrs["pruned_at_step"]
    # the first decision step (the median pruner's first, the first rung's) already holds a
    # worse value than the complete trial's: pruned there
    assert at == 10, at
    if pruner is HYPERBAND:  # the rung's value is in the study, where the trials after it
        # compare theirs (the driver asked the pruner though the gate had decided)
        assert bad.system_attrs.get("completed_rung_0") == bad.intermediate_values[10]
    lag = bad.user_attrs["prune_lag"]
    steps = _metric_steps(bad.user_attrs["run_dir"])
    assert steps == list(range(bad.user_attrs["steps"]))
    assert lag["past_step"] == len(steps) - (at + 1)
    if exact:  # the workers waited at the decision step: none past it
        assert lag["past_step"] == 0 and lag["begun_after"] == 0, lag
    else:  # the pruner's decision reached the workers ahead (its gate): the two
        # ranks, knowing a step before that step 10 decides, waited for its control
        # all-reduce at its end (not overlapped with step 11) and stopped there
        assert lag == {"past_step": 0, "begun_after": 0, "ended_after": 0}, lag
    # the study holds the trial's every step up to the decision, none after
    assert sorted(bad.intermediate_values) == list(range(at + 1))
    assert sorted(good.intermediate_values) == list(range(STEPS))
    # its workers were gone (their CPUs free) right after the trial
    assert freed[bad.number] < 1.0, freed
    assert _free_cpus(ray) == total
    # the GCS's actor table (the state API needs the dashboard, which tests leave off)
    workers = [a for a in ray._private.state.actors().values()
               if "Worker" in str(a.get("ActorClassName"))]
    assert len(workers) >= 2, workers  # both trials' workers: every one DEAD
    assert all(a.get("State") in ("DEAD", 4) for a in workers), workers


def test_a_promoted_trial_grows_and_trains_its_reference(ray_local, tmp_path):
    cfg = load_sweep({
        "study": {"name": "hb", "storage": f"sqlite:///{tmp_path}/study.db",
                  "pruner": {"type": "hyperband", "min_resource": 4, "reduction_factor": 2}},
        "promotion": {"growth": 2},
        "base": {**BASE, "max_workers": 2, "max_steps": GROWN},
        "params": {"optimizer.lr": {"type": "categorical", "choices": [0.01]}},
        "objective": "tests.integration.test_sweep_live:keep_final",
        "n_trials": 1, "max_concurrent": 1, "run_dir": str(tmp_path / "runs")})
    study = open_study(cfg)
    study.optimize(TrialRunner(cfg, None).objective, n_trials=1)
    (trial,) = study.get_trials()
    assert trial.state == TrialState.COMPLETE, trial.user_attrs
    # the first trial of a rung is always promoted; study "hb"'s trial 0 is in Hyperband's
    # bracket 0, whose first rung is at min_resource: at step 4 it asks for 2 workers
    promotions = trial.user_attrs["promotions"]
    assert promotions[0] == [4, 1, 2], promotions
    with open(os.path.join(trial.user_attrs["run_dir"], "metrics.jsonl")) as f:
        worlds = [json.loads(line)["world_size"] for line in f if line.strip()]
    assert worlds[0] == 1 and worlds[-1] == 2, worlds  # it grew in place, at a boundary
    grew = worlds.index(2)
    assert worlds[grew:] == [2] * (len(worlds) - grew) and len(worlds) == GROWN
    # (the reference: slow_mse's numbers without its sleep)
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), 8, GROWN, seed=0)
    import importlib

    final = importlib.import_module("tests.integration.test_sweep_live").FINAL
    assert max_diff(final[trial.number], ref) < 1e-5


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.cold_workers  # the scheduler brings its own pool: none of this process's holds CPUs
def test_a_sweep_shares_a_scheduler_with_an_ordinary_job(ray_local, tmp_path):
    """`elastic sweep --scheduler`: the trials are jobs in the scheduler's queue, admitted and
    sized by its policy beside an ordinary job; the pruner's hook runs next to each trial's
    controller in the scheduler's process and still stops a pruned trial at its decision."""
    import threading

    import elastic
    from elastic import scheduler

    sched = scheduler.start("sw", workers=3, policy="fifo-static", round_s=0.3, detached=False,
                            warm=3)  # the second trial takes the first one's process
    seen: list[list[dict]] = []
    done = threading.Event()

    def record() -> None:
        while not done.is_set():
            seen.append(ray_local.get(sched.rows.remote()))
            time.sleep(0.2)

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    try:
        other = elastic.submit(dict(model=mlp, optimizer=adam, loss=slow_mse,
                                    dataset=RegressionData(),
                                    global_batch_size=8, max_steps=150, num_workers=2,
                                    view="none", name="other", run_dir=str(tmp_path / "other")),
                               scheduler="sw")
        cfg = load_sweep({
            "study": {"name": "q", "storage": f"sqlite:///{tmp_path}/study.db",
                      "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 10,
                                 "interval_steps": 5}},
            "base": {**BASE, "max_steps": 100},
            "params": {"optimizer.lr": {"type": "float", "low": 1.0e-5, "high": 0.1, "log": True}},
            "enqueue": [{"optimizer.lr": 0.05}, {"optimizer.lr": 1.0e-5}],
            "n_trials": 2, "max_concurrent": 1, "run_dir": str(tmp_path / "runs")})
        from elastic.sweep import run_sweep

        study = run_sweep(cfg, scheduler="sw")
        out = other.result(timeout=240)
    finally:
        done.set()
        watcher.join(5)
        scheduler.shutdown("sw")
    assert out["state"] == "finished" and out["steps"] == 150, out
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), 8, 150, seed=0)  # no sleep
    assert max_diff(out["state_dict"], ref) < 1e-5
    good, bad = study.get_trials()
    assert good.state == TrialState.COMPLETE and good.user_attrs["steps"] == 100
    assert bad.state == TrialState.PRUNED
    at = bad.user_attrs["pruned_at_step"]
    assert at == 10
    # the gate went from the scheduler's process to the trial's one worker before step 10:
    # it stopped at that step's end (the hook opens the study in the background; were it
    # late, the driver's stop would land within ~2 steps instead: docs/sweeps.md)
    assert bad.user_attrs["prune_lag"] == {"past_step": 0, "begun_after": 0,
                                           "ended_after": 0}, bad.user_attrs["prune_lag"]
    assert sorted(bad.intermediate_values) == list(range(at + 1))  # finish() reported them
    # the trials were the scheduler's jobs, sized by its policy beside the other job
    names = {good.user_attrs["job"], bad.user_attrs["job"], "other"}
    assert names <= {r["job"] for rows in seen for r in rows}, seen[-1:]
    together = False
    for rows in seen:
        running = [r for r in rows if r["state"] == "running"]
        assert sum(r["workers"] for r in running) <= 3, rows  # never over its capacity
        for r in running:  # fifo-static: each at the size it asked for
            assert r["workers"] == (2 if r["job"] == "other" else 1) or r["resizing"], r
        together |= {r["job"] for r in running} >= {"other", good.user_attrs["job"]}
    assert together, "the sweep's trial and the other job never ran side by side"
