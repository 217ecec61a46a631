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
process dies: finished trials count toward ``n_trials``, and trials the dead process left
RUNNING are failed (heartbeat) and retried with the same parameters. See docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import optuna
from optuna.trial import TrialState

from .config import JobConfig, resolve_callable
from .errors import ClusterError, ConfigError, ElasticError

__all__ = ["Param", "SweepConfig", "load_sweep", "run_sweep", "optimize", "trial_counts",
           "format_summary", "cli"]

_TOP = ("study", "n_trials", "max_concurrent", "base", "params", "objective", "run_dir",
        "enqueue", "timeout_s")
_STUDY = ("name", "storage", "direction", "sampler", "pruner", "heartbeat_interval",
          "grace_period", "max_retry")
_PARAM_KEYS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"),
               "categorical": ("choices",)}
_OWNED = ("name", "run_dir", "view")  # set by the sweep for each trial
_OBJECTIVES = ("final_loss", "min_loss", "final_eval_loss", "min_eval_loss")
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


# ---------------------------------------------------------------------------- search space


@dataclass(frozen=True)
class Param:
    """One search dimension. ``name`` is a job field, dotted for nested settings
    (``optimizer.lr``, ``model.width``)."""

    name: str
    type: str
    low: float = 0.0  # float and int
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    @classmethod
    def parse(cls, name: str, spec: Any) -> Param:
        where = f"params.{name}"
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(where, f"must be a mapping with a type, got {spec!r}.",
                              "e.g. {type: float, low: 1.0e-4, high: 0.1, log: true}")
        kind = spec["type"]
        if kind not in _PARAM_KEYS:
            raise ConfigError(f"{where}.type", f"unknown parameter type {kind!r}.",
                              f"use one of: {', '.join(_PARAM_KEYS)}")
        unknown = sorted(set(spec) - {"type", *_PARAM_KEYS[kind]})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"is not a setting of a {kind} parameter.",
                              f"use: {', '.join(_PARAM_KEYS[kind])}")
        if kind == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"{where}.choices", "must be a non-empty list.",
                                  "e.g. choices: [dp, zero1]")
            bad = [c for c in choices if not isinstance(c, (str, int, float, bool, type(None)))]
            if bad:
                raise ConfigError(f"{where}.choices", f"{bad[0]!r} is not a scalar; Optuna "
                                  "stores only None, bool, int, float and str choices.",
                                  "search a scalar (e.g. optimizer.name) instead of a mapping")
            return cls(name, kind, choices=tuple(choices))
        vals: dict[str, Any] = {}
        for key in ("low", "high", "step"):
            v = spec.get(key)
            if v is None:
                if key != "step":
                    raise ConfigError(f"{where}.{key}", "is required.", f"add {key}: <number>")
                continue
            try:  # YAML reads 1e-4 (no dot) as a string: accept it
                x = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.{key}", f"{v!r} is not a number.",
                                  "write a number, e.g. 1.0e-4") from None
            if kind == "int" and x != int(x):
                raise ConfigError(f"{where}.{key}", f"{v!r} is not an integer.",
                                  "use whole numbers, or type: float")
            vals[key] = int(x) if kind == "int" else x
        if vals["low"] > vals["high"]:
            raise ConfigError(where, f"low {vals['low']} is above high {vals['high']}.",
                              "swap them")
        log = bool(spec.get("log", False))
        if log and vals["low"] <= 0:
            raise ConfigError(f"{where}.low", "must be > 0 with log: true.", "use a positive low")
        if log and "step" in vals:
            raise ConfigError(f"{where}.step", "cannot be combined with log: true.",
                              "drop step or log")
        return cls(name, kind, vals["low"], vals["high"], log, vals.get("step"))

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high),
                                     step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def probes(self) -> list[Any]:
        """Values that stand for the whole range when the base job is validated up front."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def grid(self) -> list[Any]:
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int" and not self.log:
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.type == "float" and self.step and not self.log:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        raise ConfigError(f"params.{self.name}", "the grid sampler needs a finite set of values.",
                          "make it categorical, a non-log int, or a float with a step; or use "
                          "sampler: tpe/random")


def _set_path(fields: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a job-field dict. A string at ``optimizer`` becomes {name: ...};
    an import string elsewhere becomes {target: ...}, so its factory gets the keyword."""
    parts = dotted.split(".")
    node = fields
    for depth, key in enumerate(parts[:-1]):
        cur = node.get(key)
        if cur is None:
            cur = {}
        elif isinstance(cur, str):
            cur = {"name": cur} if depth == 0 and key == "optimizer" and ":" not in cur else {
                "target": cur}
        elif not isinstance(cur, dict):
            raise ConfigError(f"params.{dotted}", f"{'.'.join(parts[:depth + 1])} holds a "
                              f"{type(cur).__name__}, whose settings cannot be searched.",
                              "give it as {target: 'module:factory', ...} in base")
        else:
            cur = dict(cur)
        node[key] = cur
        node = cur
    node[parts[-1]] = value


# ---------------------------------------------------------------------------- the sweep file


@dataclass
class SweepConfig:
    """A validated sweep: the study, the base job (JobConfig fields), the search space."""

    base: dict[str, Any]
    params: dict[str, Param]
    n_trials: int = 10
    max_concurrent: int | None = None
    objective: Any = "final_loss"
    study_name: str = "sweep"
    storage: str | None = None  # default: sqlite:///<run_dir>/study.db
    direction: str = "minimize"
    sampler: dict[str, Any] = field(default_factory=lambda: {"type": "tpe"})
    pruner: dict[str, Any] = field(default_factory=lambda: {"type": "median"})
    heartbeat_interval: int = 10
    grace_period: int | None = None  # default: 6 x heartbeat_interval (a loaded host can
    # starve the heartbeat thread; a shorter grace failed live trials in tests)
    max_retry: int = 3
    run_dir: str | None = None  # default: ./runs/<study name>
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    timeout_s: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepConfig:
        if not isinstance(data, dict):
            raise ConfigError("sweep file", "must hold a mapping.", "see docs/sweeps.md")
        unknown = sorted(set(data) - set(_TOP))
        if unknown:
            raise ConfigError(unknown[0], "is not a sweep setting.",
                              f"use one of: {', '.join(_TOP)}")
        study = data.get("study") or {}
        if not isinstance(study, dict):
            raise ConfigError("study", "must be a mapping.", "e.g. study: {name: my-sweep}")
        unknown = sorted(set(study) - set(_STUDY))
        if unknown:
            raise ConfigError(f"study.{unknown[0]}", "is not a study setting.",
                              f"use one of: {', '.join(_STUDY)}")
        base = data.get("base")
        if isinstance(base, str):
            base = _load_yaml(base, "base")
        if isinstance(base, JobConfig):
            base = base.settings()
        if not isinstance(base, dict):
            raise ConfigError("base", "is required: the job every trial starts from.",
                              "give a mapping of job settings or the path of a job file")
        params = data.get("params") or {}
        if not isinstance(params, dict) or not params:
            raise ConfigError("params", "must map job fields to search dimensions.",
                              "e.g. params: {optimizer.lr: {type: float, low: 1.0e-4, high: 0.1}}")
        kw: dict[str, Any] = {
            "base": dict(base),
            "params": {str(k): v if isinstance(v, Param) else Param.parse(str(k), v)
                       for k, v in params.items()},
        }
        for key in ("n_trials", "max_concurrent", "objective", "run_dir", "enqueue", "timeout_s"):
            if data.get(key) is not None:
                kw[key] = data[key]
        for key in ("storage", "direction", "heartbeat_interval", "grace_period", "max_retry"):
            if study.get(key) is not None:
                kw[key] = study[key]
        if study.get("name") is not None:
            kw["study_name"] = str(study["name"])
        for key in ("sampler", "pruner"):
            spec = study.get(key)
            if spec is not None:
                kw[key] = {"type": spec} if isinstance(spec, str) else spec
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_yaml(cls, path: str) -> SweepConfig:
        data = _load_yaml(path, "sweep file")
        data.setdefault("study", {})
        if isinstance(data["study"], dict) and "name" not in data["study"]:
            data["study"]["name"] = os.path.splitext(os.path.basename(path))[0]
        return cls.from_dict(data)

    # ------------------------------------------------------------------ derived

    @property
    def run_path(self) -> str:
        return os.path.abspath(self.run_dir or os.path.join("runs", self.study_name))

    @property
    def storage_url(self) -> str:
        return self.storage or "sqlite:///" + os.path.join(self.run_path, "study.db")

    @property
    def storage_shown(self) -> str:
        """The storage URL with any password hidden."""
        from sqlalchemy.engine import make_url

        try:
            return make_url(self.storage_url).render_as_string(hide_password=True)
        except Exception:
            return "<invalid storage URL>"

    def job_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The base job with ``values`` (param name -> value) set; the base is not changed."""
        fields = dict(self.base)  # _set_path copies each mapping it changes
        for name, value in values.items():
            _set_path(fields, name, value)
        return fields

    def probe_configs(self) -> list[JobConfig]:
        """One JobConfig per edge of each dimension (other dimensions at their first probe)."""
        first = {n: p.probes()[0] for n, p in self.params.items()}
        out = []
        for n, p in self.params.items():
            for v in p.probes():
                fields = self.job_fields({**first, n: v})
                fields.update(view="none")
                try:
                    cfg = JobConfig.from_dict(fields)
                    cfg.validate()
                except ConfigError as e:  # a searched value's own error, else the base's
                    point = {**first, n: v}
                    hit = e.field if e.field in point else n if e.field == n.split(".")[0] else None
                    if hit is not None:
                        raise ConfigError(f"params.{hit}", f"value {point[hit]!r}: {e.problem}",
                                          e.fix) from None
                    raise ConfigError(f"base.{e.field}", e.problem, e.fix) from None
                _check_arguments(n, fields)
                out.append(cfg)
        return out

    def validate(self) -> None:
        """Check everything that can be checked without Ray or the storage; raise ConfigError."""
        for key in ("n_trials", "heartbeat_interval"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(key, f"must be a positive integer, got {v!r}.",
                                  f"set {key}: 1 or more")
        for key in ("max_concurrent", "grace_period"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(key, f"must be a positive integer, got {v!r}.",
                                  "set it to 1 or more, or leave it out")
        if not isinstance(self.max_retry, int) or self.max_retry < 0:
            raise ConfigError("study.max_retry", f"must be >= 0, got {self.max_retry!r}.",
                              "0 disables retries of trials left by a dead sweep")
        if self.direction not in ("minimize", "maximize"):
            raise ConfigError("study.direction", f"unknown direction {self.direction!r}.",
                              "use minimize or maximize")
        if not (callable(self.objective) or self.objective in _OBJECTIVES or (
                isinstance(self.objective, str) and ":" in self.objective)):
            raise ConfigError("objective", f"unknown objective {self.objective!r}.",
                              f"use {' or '.join(_OBJECTIVES)}, or 'module:fn' taking the "
                              "FitResult")
        if self.objective in ("final_eval_loss", "min_eval_loss") and \
                not self.base.get("eval_dataset") and "eval_dataset" not in self.params:
            raise ConfigError("objective", f"{self.objective} needs an evaluation set.",
                              "set base.eval_dataset (and eval_every), or use final_loss")
        self.objective_fn()
        job_fields = JobConfig.setting_names()
        for name in self.params:
            top = name.split(".")[0]
            if top in _OWNED:
                raise ConfigError(f"params.{name}", f"{top} is set by the sweep for each trial.",
                                  "search another field")
            if top not in job_fields:
                raise ConfigError(f"params.{name}", f"{top} is not a job field.",
                                  f"use one of: {', '.join(job_fields)}")
        for i, point in enumerate(self.enqueue):
            extra = sorted(set(point) - set(self.params)) if isinstance(point, dict) else ["?"]
            if extra:
                raise ConfigError(f"enqueue[{i}]", f"{extra[0]!r} is not a searched parameter.",
                                  f"use names from params: {', '.join(self.params)}")
        if self.storage is not None and not isinstance(self.storage, str):
            raise ConfigError("study.storage", "must be a SQLAlchemy URL string.",
                              "e.g. sqlite:///runs/sweep.db")
        self.make_sampler()
        self.make_pruner()
        probes = self.probe_configs()
        for cfg in probes[:1]:  # code is the same in every probe unless it is searched
            cfg.model_factory()
            cfg.optimizer_factory()
            cfg.loss_fn()

    # ------------------------------------------------------------------ Optuna parts

    def objective_fn(self) -> Callable[[Any], float]:
        if self.objective == "final_loss":
            return lambda r: r.final_loss
        if self.objective == "min_loss":
            return lambda r: min((h["loss"] for h in r.history if math.isfinite(h["loss"])),
                                 default=float("nan"))
        if self.objective in ("final_eval_loss", "min_eval_loss"):
            pick = min if self.objective == "min_eval_loss" else (lambda xs: xs[-1])
            return lambda r: pick([h["eval_loss"] for h in r.history if "eval_loss" in h]
                                  or [float("nan")])
        return resolve_callable(self.objective, "objective")

    def make_sampler(self) -> optuna.samplers.BaseSampler:
        spec = dict(self.sampler)
        kind = spec.pop("type", "tpe")
        if kind == "grid":
            space = {n: p.grid() for n, p in self.params.items()}
            return _build("study.sampler", optuna.samplers.GridSampler, space, **spec)
        classes = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
        if kind not in classes:
            raise ConfigError("study.sampler", f"unknown sampler {kind!r}.",
                              "use tpe, random or grid")
        return _build("study.sampler", classes[kind], **spec)

    def make_pruner(self) -> optuna.pruners.BasePruner:
        spec = dict(self.pruner)
        kind = spec.pop("type", "median")
        if kind == "hyperband":
            spec.setdefault("max_resource", int(self.base.get("max_steps") or 0) or "auto")
        classes = {"median": optuna.pruners.MedianPruner,
                   "hyperband": optuna.pruners.HyperbandPruner, "none": optuna.pruners.NopPruner}
        if kind not in classes:
            raise ConfigError("study.pruner", f"unknown pruner {kind!r}.",
                              "use median, hyperband or none")
        return _build("study.pruner", classes[kind], **spec)

    def make_storage(self) -> optuna.storages.RDBStorage:
        """Open (and create) the RDB storage; an unreachable one is a ConfigError."""
        from sqlalchemy.engine import make_url

        url = self.storage_url
        try:
            u = make_url(url)
        except Exception as e:
            raise ConfigError("study.storage", f"{url!r} is not a SQLAlchemy URL ({e}).",
                              "use e.g. sqlite:///runs/sweep.db or "
                              "postgresql://user:password@host/db") from None
        shown = u.render_as_string(hide_password=True)
        backend = u.get_backend_name()
        engine_kwargs: dict[str, Any] = {}
        if backend == "sqlite":
            if u.database and u.database != ":memory:":
                d = os.path.dirname(os.path.abspath(u.database))
                if not os.path.isdir(d):
                    raise ConfigError("study.storage", f"the SQLite file {u.database} would be "
                                      f"in {d}, which does not exist.",
                                      "create that directory, or leave storage out to use "
                                      "sqlite:///<run_dir>/study.db")
            engine_kwargs = {"connect_args": {"timeout": 60}}  # trial threads share the file
        elif backend in ("postgresql", "mysql"):
            engine_kwargs = {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
        retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = ({"heartbeat_stale_trial_callback": retry_cls(max_retry=self.max_retry)}
                         if retry_cls is not None else  # optuna < 4.9
                         {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(
                             max_retry=self.max_retry)})
                return optuna.storages.RDBStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=self.heartbeat_interval,
                    grace_period=self.grace_period or 6 * self.heartbeat_interval, **retry)
        except Exception as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError("study.storage", f"cannot open {shown}: {type(e).__name__}: {cause}",
                              "check that the database is up and reachable, that its driver is "
                              "installed (e.g. psycopg2 for postgresql://) and that the URL is "
                              "right") from None

    def open_study(self) -> optuna.Study:
        """Create the study, or load it if the storage has it (a resumed sweep)."""
        study = optuna.create_study(
            study_name=self.study_name, storage=self.make_storage(), sampler=self.make_sampler(),
            pruner=self.make_pruner(),
            direction="maximize" if self.direction == "maximize" else "minimize",
            load_if_exists=True)
        if study.direction.name.lower() != self.direction:
            raise ConfigError("study.direction", f"the stored study {self.study_name!r} was "
                              f"created to {study.direction.name.lower()}.",
                              "use the same direction or another study name")
        for point in self.enqueue:
            study.enqueue_trial(point, skip_if_exists=True)
        # Fail (and re-queue) what a dead sweep left RUNNING now, in one thread: Optuna also
        # does it as each trial starts, but concurrent trial threads can both fail the same
        # trial on SQLite (no row locks) and queue it twice.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        return study


def _check_arguments(name: str, fields: dict[str, Any]) -> None:
    """A searched keyword of a factory (``model.width``) must be one the factory takes."""
    import inspect

    top = name.split(".")[0]
    spec = fields.get(top)
    if "." not in name or not isinstance(spec, dict) or "target" not in spec:
        return
    target = resolve_callable(spec["target"], top)
    kwargs = {k: v for k, v in spec.items() if k != "target"}
    try:
        inspect.signature(target).bind_partial(**kwargs)
    except TypeError as e:
        raise ConfigError(f"params.{name}", f"{spec['target']} does not take it ({e}).",
                          "search an argument the factory takes, or make the factory take it"
                          ) from None
    except ValueError:  # no signature (a builtin): the trial will tell
        return


def _build(where: str, cls: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return cls(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(where, f"{cls.__name__} rejects {kwargs}: {e}",
                          "see the Optuna documentation of that class for its settings") from None


def _load_yaml(path: str, what: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(what, f"{path} does not exist.", "check the path") from None
    except yaml.YAMLError as e:
        raise ConfigError(what, f"{path} is not valid YAML: {e}", "fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(what, f"{path} must hold a mapping.", "see docs/sweeps.md")
    return data


def load_sweep(source: SweepConfig | dict[str, Any] | str) -> SweepConfig:
    """A SweepConfig from a sweep file path, a dict of its contents, or itself."""
    if isinstance(source, SweepConfig):
        source.validate()
        return source
    if isinstance(source, str):
        return SweepConfig.from_yaml(source)
    return SweepConfig.from_dict(source)


# ---------------------------------------------------------------------------- running


class _Runner:
    """Runs the trials of one sweep invocation. Trial threads share it; ``_lock`` guards output."""

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
        from .api import fit

        cfg = self.cfg
        values = {name: p.suggest(trial) for name, p in cfg.params.items()}
        fields = cfg.job_fields(values)
        run_dir = os.path.join(cfg.run_path, f"trial-{trial.number:04d}")
        fields.update(name=f"{cfg.study_name}-trial-{trial.number}", run_dir=run_dir, view="none")
        trial.set_user_attr("run_dir", run_dir)
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
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in trial.params.items())
        a = trial.user_attrs
        if trial.state == TrialState.COMPLETE:
            what = f"complete: {_fmt(trial.value)}"
        elif trial.state == TrialState.PRUNED:
            what = f"pruned at step {a.get('pruned_at_step')}"
        else:
            what = f"{trial.state.name.lower()}: {a.get('error', 'see the log above')}"
        self.say(f"trial {trial.number} {what} ({params}; world {a.get('world_size')}, "
                 f"{a.get('strategy')}, {a.get('seconds')}s, {a.get('run_dir')})")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """Trials per state, lower-case names: complete, pruned, fail, running, waiting."""
    out = {s.name.lower(): 0 for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] += 1
    return out


def _connect(probes: list[JobConfig]) -> bool:
    """Attach to the job's Ray cluster (or start a local one); True if this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    from ._ctl_base import check_reachable as _check_reachable

    base = probes[0]
    addr = base.ray_address or os.environ.get("RAY_ADDRESS")
    if addr and addr not in ("local", "auto"):
        _check_reachable(addr)
        try:
            ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False)
        except Exception as e:
            raise ClusterError(f"cannot connect to the Ray cluster at {addr}: {e}. Fix: check "
                               "the address, or unset RAY_ADDRESS for a local one.") from e
    elif addr == "auto":
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    else:
        need = max(c.max_world * float(c.resources_per_worker.get("CPU", 1)) for c in probes)
        ray.init(address="local", num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    return True


def _concurrency(cfg: SweepConfig, probes: list[JobConfig]) -> int:
    """How many trials the cluster holds at once (each at its largest), capped by max_concurrent."""
    import ray

    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for c in probes:
        res = dict(c.resources_per_worker)
        res.setdefault("CPU", 1)
        if c.use_gpu or (c.use_gpu is None and total.get("GPU", 0) > 0):
            res["GPU"] = max(1.0, float(res.get("GPU", 1)))
        for k, v in res.items():
            need[k] = max(need.get(k, 0.0), float(v) * c.max_world)
    fits = min((int(total.get(k, 0) // v) for k, v in need.items() if v > 0), default=1)
    if fits < 1:
        raise ClusterError(f"one trial needs {need} but the cluster has {total}. Fix: search "
                           "smaller num_workers/resources_per_worker, or add nodes.")
    return max(1, min(fits, cfg.max_concurrent or fits))


def run_sweep(config: SweepConfig | dict[str, Any] | str, *, n_trials: int | None = None,
              out: TextIO | None = None) -> optuna.Study:
    """Run (or resume) a sweep until ``n_trials`` trials of its study have finished
    (complete or pruned) and return the study.

    ``config`` is a sweep file path, a dict of its contents or a SweepConfig; ``n_trials``
    overrides the file's. Progress lines go to ``out`` if given. Raises ``ConfigError`` for a
    bad sweep (before any trial starts), ``ClusterError`` when Ray cannot host one trial.
    Errors inside a trial fail that trial only; the sweep goes on.
    """
    cfg = load_sweep(config)
    if n_trials is not None:
        cfg = dataclasses.replace(cfg, n_trials=n_trials)
        cfg.validate()
    probes = cfg.probe_configs()
    if cfg.storage is None:
        os.makedirs(cfg.run_path, exist_ok=True)
    study = cfg.open_study()
    runner = _Runner(cfg, out)
    done = sum(trial_counts(study)[s.name.lower()] for s in _FINISHED)
    remaining = cfg.n_trials - done
    if remaining <= 0:
        runner.say(f"study {cfg.study_name}: {done} trials already finished (n_trials "
                   f"{cfg.n_trials}); nothing to run")
        return study
    started = _connect(probes)
    try:
        n_jobs = _concurrency(cfg, probes)
        runner.say(f"study {cfg.study_name} in {cfg.storage_shown}: {done} finished, "
                   f"running {remaining} more, {n_jobs} at a time; trial runs under {cfg.run_path}")
        study.optimize(
            runner.objective, n_trials=remaining, n_jobs=n_jobs, timeout=cfg.timeout_s,
            catch=(ElasticError,), gc_after_trial=False, show_progress_bar=False,
            callbacks=[optuna.study.MaxTrialsCallback(cfg.n_trials, states=_FINISHED),
                       runner.after_trial])
    finally:
        if started:
            import ray

            ray.shutdown()
    return study


def optimize(base: JobConfig | dict[str, Any], params: dict[str, Any], n_trials: int, *,
             study_name: str = "sweep", storage: str | None = None, direction: str = "minimize",
             sampler: str | dict[str, Any] = "tpe", pruner: str | dict[str, Any] = "median",
             max_concurrent: int | None = None, objective: Any = "final_loss",
             run_dir: str | None = None, out: TextIO | None = None) -> optuna.Study:
    """The SDK form of a sweep file: ``base`` may hold Python objects (callables, datasets)."""
    return run_sweep({
        "study": {"name": study_name, "storage": storage, "direction": direction,
                  "sampler": sampler, "pruner": pruner},
        "base": base, "params": params, "n_trials": n_trials, "max_concurrent": max_concurrent,
        "objective": objective, "run_dir": run_dir}, out=out)


# ---------------------------------------------------------------------------- reporting


def format_summary(study: optuna.Study, max_rows: int = 20) -> str:
    """A plain-text table: counts per state, the best trial and its parameters, the trials."""
    trials = study.get_trials(deepcopy=False)
    c = trial_counts(study)
    lines = [f"study {study.study_name}: {len(trials)} trials: {c['complete']} complete, "
             f"{c['pruned']} pruned, {c['fail']} failed, {c['running']} running, "
             f"{c['waiting']} waiting"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        lines.append(f"best: trial {best.number}, value {_fmt(best.value)}, "
                     f"run directory {best.user_attrs.get('run_dir')}")
        lines += [f"  {k} = {_fmt(v)}" for k, v in best.params.items()]
    else:
        lines.append("best: no complete trial yet")
    names = sorted({k for t in trials for k in t.params})
    head = ["trial", "state", "value", "steps", "world", "ran_as", *names]
    rows = [[str(t.number), t.state.name.lower(), _fmt(t.value) if t.value is not None else "-",
             str(t.user_attrs.get("steps", "-")), str(t.user_attrs.get("world_size", "-")),
             str(t.user_attrs.get("strategy", "-")), *[_fmt(t.params.get(n, "-")) for n in names]]
            for t in trials[:max_rows]]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    if len(trials) > max_rows:
        lines.append(f"... {len(trials) - max_rows} more trials")
    return "\n".join(lines)


def cli(path: str, n_trials: int | None = None) -> int:
    """``elastic sweep FILE``: run the sweep, print progress and the summary; 1 if no trial
    completed."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = run_sweep(path, n_trials=n_trials, out=sys.stdout)
    print(format_summary(study))
    return 0 if trial_counts(study)["complete"] else 1
