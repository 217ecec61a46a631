"""Sweep inputs that passed ``check_sweep`` and then failed after Ray started (found by review,
session 44): each is now one ``ConfigError`` naming the field before Ray, or, for the
objective, a failure of that trial only. No Ray here: the trial's job is replaced by a result.
"""

from __future__ import annotations

import copy
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from elastic.control import FitResult
from elastic.errors import ConfigError, ElasticError
from elastic.sweep import load_sweep
from elastic.sweep.runner import TrialRunner
from elastic.sweep.sweep_file import SweepConfig

BASE = {"model": "tests.helpers:mlp", "optimizer": {"name": "adam", "lr": 0.01}, "loss": "mse",
        "dataset": "tests.helpers:RegressionData", "global_batch_size": 8, "max_steps": 6,
        "num_workers": 1}
PARAMS = {"optimizer.lr": {"type": "float", "low": 1.0e-4, "high": 0.1, "log": True},
          "strategy": {"type": "categorical", "choices": ["dp", "zero1"]},
          "num_workers": {"type": "int", "low": 1, "high": 3},
          "max_grad_norm": {"type": "float", "low": 0.5, "high": 2.0, "step": 0.5}}


def _sweep(tmp_path, **kw: Any) -> dict[str, Any]:
    data = {"study": {"name": "t", "storage": f"sqlite:///{tmp_path}/study.db",
                      "sampler": {"type": "random", "seed": 0}, "pruner": "none"},
            "base": dict(BASE), "params": copy.deepcopy(PARAMS), "n_trials": 2,
            "run_dir": str(tmp_path / "runs")}
    data.update(kw)
    return data


@pytest.mark.parametrize("point, field", [
    ({"strategy": "zero9"}, "enqueue[0].strategy"),  # Optuna: ValueError in the trial
    ({"optimizer.lr": 5.0}, "enqueue[0].optimizer.lr"),  # Optuna: ran with lr 5.0
    ({"optimizer.lr": "fast"}, "enqueue[0].optimizer.lr"),
    ({"num_workers": 2.5}, "enqueue[0].num_workers"),
    ({"num_workers": 9}, "enqueue[0].num_workers"),
    ({"max_grad_norm": 0.7}, "enqueue[0].max_grad_norm"),  # off the step's grid
])
def test_an_enqueued_point_outside_its_space_is_one_config_error(tmp_path, point, field):
    data = _sweep(tmp_path, enqueue=[point])
    with pytest.raises(ConfigError) as e:
        load_sweep(data)  # every check before Ray
    assert e.value.field == field and e.value.fix, str(e.value)


def test_an_enqueued_point_in_its_space_is_kept_as_the_trial_gets_it(tmp_path):
    point = {"strategy": "zero1", "optimizer.lr": "1e-3", "num_workers": 2.0,
             "max_grad_norm": 1.5}
    cfg = load_sweep(_sweep(tmp_path, enqueue=[point, {"strategy": "dp"}]))
    assert cfg.enqueue == [{"strategy": "zero1", "optimizer.lr": 1e-3, "num_workers": 2,
                            "max_grad_norm": 1.5}, {"strategy": "dp"}]
    with pytest.raises(ConfigError) as e:
        load_sweep(_sweep(tmp_path, enqueue=["dp"]))
    assert e.value.field == "enqueue[0]"


@pytest.mark.parametrize("name, step", [("optimizer.lr", 0), ("max_grad_norm", -0.5),
                                        ("num_workers", 0), ("num_workers", -1),
                                        ("max_grad_norm", "nan")])
def test_a_step_that_is_not_positive_is_one_config_error(tmp_path, name, step):
    data = _sweep(tmp_path)
    data["params"][name] = {**data["params"][name], "step": step}
    data["params"][name].pop("log", None)
    with pytest.raises(ConfigError) as e:
        load_sweep(data)
    assert e.value.field == f"params.{name}.step" and e.value.fix


@pytest.mark.parametrize("timeout", ["soon", 0, -5, float("inf"), float("nan"), True, [1]])
def test_a_bad_timeout_is_one_config_error(tmp_path, timeout):
    with pytest.raises(ConfigError) as e:
        load_sweep(_sweep(tmp_path, timeout_s=timeout))
    assert e.value.field == "timeout_s" and e.value.fix


def test_a_timeout_yaml_read_as_a_string_is_read_as_a_number(tmp_path):
    path = tmp_path / "sweep.yaml"
    import yaml

    path.write_text(yaml.safe_dump(_sweep(tmp_path)) + "timeout_s: 1e4\n")  # a str to YAML
    assert load_sweep(str(path)).timeout_s == 1e4


def raising_objective(result: FitResult) -> float:
    raise KeyError("eval_loss")


def test_a_relative_sqlite_storage_is_opened_where_the_sweep_runs(tmp_path, monkeypatch):
    """``storage: sqlite:///runs/sweep.db`` (the docs' form) names a file from where the
    sweep runs; a scheduler's process, which opens the study for the pruner's hook, runs
    elsewhere. The URL is made absolute. Was: every scheduled trial failed with 'unable to
    open database file' (found by a new user, session 48)."""
    monkeypatch.chdir(tmp_path)
    for given, want in (("sqlite:///runs/sweep.db", f"sqlite:///{tmp_path}/runs/sweep.db"),
                        (f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/a.db"),
                        ("sqlite:///:memory:", "sqlite:///:memory:"),
                        ("postgresql://u:pw@h/db", "postgresql://u:pw@h/db")):
        data = _sweep(tmp_path)
        data["study"]["storage"] = given
        cfg = load_sweep(data)
        assert cfg.storage_url == want, given
    monkeypatch.chdir("/")  # elsewhere, as the scheduler's process is
    assert load_sweep(_sweep(tmp_path)).storage_url == f"sqlite:///{tmp_path}/study.db"


@pytest.mark.parametrize("grace, ok", [(1, False), (9, False), (10, True), (60, True)])
def test_a_grace_period_shorter_than_two_heartbeats_is_refused(tmp_path, grace, ok):
    """grace_period 1 against heartbeat_interval 5: a live trial was failed as stale, run
    again, and the sweep crashed ("Cannot tell a FAIL trial"; found by a new user, session
    48). Refused before any trial, naming the setting."""
    data = _sweep(tmp_path)
    data["study"].update(heartbeat_interval=5, grace_period=grace)
    if ok:
        load_sweep(data)
        return
    with pytest.raises(ConfigError) as e:
        load_sweep(data)
    assert e.value.field == "study.grace_period" and "10 or more" in e.value.fix


def _run_trials(tmp_path, monkeypatch, objective: Any) -> list[optuna.trial.FrozenTrial]:
    """Two trials as ``run_sweep`` runs them (``catch=(ElasticError,)``), each job's result
    given without Ray."""
    cfg = SweepConfig.from_dict(_sweep(tmp_path, objective=objective))
    runner = TrialRunner(cfg, None)
    result = FitResult({}, [{"step": 0, "loss": 0.5}], [], str(tmp_path))
    monkeypatch.setattr(runner, "_run", lambda trial, job: result)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(runner.objective, n_trials=2, catch=(ElasticError,))  # (was: it raised)
    return study.get_trials()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_signal_to_a_trials_job_ends_the_sweep_with_its_exit_code(tmp_path, monkeypatch):
    """Ctrl-C (SIGTERM) stops the running trial's job (InterruptedJobError): the trial is
    failed and the sweep ends with the job's error, not the next trial. Was: that trial
    failed and the others ran to the end, exit 0 (found by a new user, session 48)."""
    import signal

    from elastic.errors import InterruptedJobError
    from elastic.sweep.runner import optimize_trials

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    cfg = SweepConfig.from_dict(_sweep(tmp_path))
    runner = TrialRunner(cfg, None)

    def stopped(trial, job):
        raise InterruptedJobError(signal.SIGTERM)

    monkeypatch.setattr(runner, "_run", stopped)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    with pytest.raises(InterruptedJobError) as e:
        optimize_trials(study, runner, n_trials=4)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Optuna's "Trial 0 failed because of..."
def test_an_objective_that_raises_fails_its_trial_only(tmp_path, monkeypatch):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials = _run_trials(tmp_path, monkeypatch,
                         "tests.unit.test_sweep_inputs:raising_objective")
    assert [t.state for t in trials] == [TrialState.FAIL] * 2
    error = trials[0].user_attrs["error"]
    assert error.startswith("ElasticError: objective 'tests.unit.test_sweep_inputs:"
                            "raising_objective' raised KeyError"), error
    assert "Fix:" in error and "seconds" in trials[0].user_attrs


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_objective_that_returns_none_fails_its_trial_only(tmp_path, monkeypatch):
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    def no_value(result: FitResult) -> Any:
        return None

    trials = _run_trials(tmp_path, monkeypatch, no_value)
    assert [t.state for t in trials] == [TrialState.FAIL] * 2
    assert "no_value' returned None, not a number" in trials[1].user_attrs["error"]
    ok = _run_trials(tmp_path, monkeypatch, lambda r: r.final_loss * 2)
    assert [(t.state, t.value) for t in ok] == [(TrialState.COMPLETE, 1.0)] * 2
