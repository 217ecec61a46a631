"""The sweep file: its settings, the base job, and the job each trial runs.

``SweepConfig`` is a sweep file read and checked: the study's settings, the base job
(``JobConfig`` fields), the search space (``space.Param``), the objective. It builds the job
fields of a trial (``trial_fields``) and one probe job per edge of the search space
(``probe_configs``), which is how a bad value is found before Ray starts.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import JobConfig, resolve_callable
from ..config.flat import flatten
from ..errors import ConfigError
from .space import Param, read_number, set_path

__all__ = ["SweepConfig", "load_yaml", "child_uri", "OWNED", "OBJECTIVES"]

_TOP = ("study", "n_trials", "max_concurrent", "base", "params", "objective", "run_dir",
        "enqueue", "timeout_s", "promotion", "scheduler", "pruning")
_STUDY = ("name", "storage", "direction", "sampler", "pruner", "heartbeat_interval",
          "grace_period", "max_retry")
OWNED = ("name", "run_dir", "view")  # set by the sweep for each trial
OBJECTIVES = ("final_loss", "min_loss", "final_eval_loss", "min_eval_loss")


@dataclass
class SweepConfig:
    """A sweep: the study, the base job (JobConfig fields), the search space.

    ``from_dict``/``from_yaml`` check the file's own settings and the jobs it makes
    (``validate``); ``run.load_sweep`` adds the checks that build Optuna's sampler and pruner
    and each searched factory once.
    """

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
    promotion: float | None = None  # growth of a promoted trial's workers per rung (hyperband)
    scheduler: str | None = None  # run the trials through this elastic scheduler's queue
    # pruning: {exact: true}: a trial's job pauses after each step where the pruner can
    # decide, so a pruned trial trains no step past it (each pause costs ~20-40 ms); the
    # default trains on and stops the workers within a step of the decision (docs/sweeps.md)
    exact_pruning: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepConfig:
        """The sweep of a sweep file's contents; ``ConfigError`` naming the setting."""
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
            base = load_yaml(base, "base")
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
        for key in ("n_trials", "max_concurrent", "objective", "run_dir", "enqueue", "timeout_s",
                    "scheduler"):
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
        promo = data.get("promotion")
        if promo is not None:
            kw["promotion"] = promo.get("growth") if isinstance(promo, dict) and set(promo) <= {
                "growth"} else promo if isinstance(promo, (int, float)) else "?"
        kw["exact_pruning"] = _exact_pruning(data.get("pruning"))
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_yaml(cls, path: str) -> SweepConfig:
        """The sweep of a file; the study is named after the file unless it says otherwise."""
        data = load_yaml(path, "sweep file")
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
        """``storage`` (a SQLite file's relative path made absolute: a scheduler's process
        opens it from its own directory; was: every scheduled trial failed with "unable to
        open database file"), or the run directory's ``study.db``."""
        if not self.storage:
            return "sqlite:///" + os.path.join(self.run_path, "study.db")
        from sqlalchemy.engine import make_url

        try:
            url = make_url(self.storage)
        except Exception:  # noqa: BLE001 - said where it is checked (validate)
            return self.storage
        db = url.database
        if url.get_backend_name() != "sqlite" or not db or db == ":memory:" or \
                db.startswith("file:") or os.path.isabs(db):
            return self.storage
        return url.set(database=os.path.abspath(db)).render_as_string(hide_password=False)

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
        fields = dict(self.base)  # set_path copies each mapping it changes
        for name, value in values.items():
            set_path(fields, name, value)
        return fields

    def trial_fields(self, number: int, values: dict[str, Any]) -> dict[str, Any]:
        """The job of trial ``number``: ``job_fields(values)`` plus what the sweep owns: the
        name ``<study>-trial-<n>``, the run directory ``<run_dir>/trial-NNNN``, no view, and,
        when the base job sets ``checkpoint_uri``, a URI of the trial's own under it
        (``<checkpoint_uri>/<study>/trial-NNNN``): trials are jobs, and a checkpoint URI
        belongs to one job."""
        # flat: a base giving ``checkpoints: {uri: ...}`` or ``output: {name: ...}`` nested
        # must get the trial's own URI and name too (was: every trial the base's URI)
        fields = flatten(self.job_fields(values))
        tag = f"trial-{number:04d}"
        fields.update(name=f"{self.study_name}-trial-{number}",
                      run_dir=os.path.join(self.run_path, tag), view="none")
        uri = fields.get("checkpoint_uri")
        if isinstance(uri, str) and uri and "checkpoint_uri" not in self.params:
            # under the study's name: two studies sharing a base URI never share a trial's
            study = re.sub(r"[^A-Za-z0-9_-]", "_", self.study_name)  # (no "..": no way up)
            fields["checkpoint_uri"] = child_uri(uri, f"{study}/{tag}")
        return fields

    def probe_configs(self) -> list[JobConfig]:
        """One JobConfig per edge of each dimension (other dimensions at their first probe),
        each validated; ``ConfigError`` naming ``params.<name>`` (a searched value) or
        ``base.<field>``."""
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
                check_arguments(n, fields)
                out.append(cfg)
        return out

    def validate(self) -> None:
        """Check the file's settings and the jobs it makes (each edge of the search space
        validated as a job, its code resolved), without Ray, Optuna or the storage; raise
        ``ConfigError``."""
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
        if self.grace_period is not None and self.grace_period < 2 * self.heartbeat_interval:
            # (was: a live trial taken for dead and run again, then the sweep crashed with
            # Optuna's "Cannot tell a FAIL trial"; found by a new user, session 48)
            raise ConfigError("study.grace_period", f"{self.grace_period} s is less than twice "
                              f"heartbeat_interval ({self.heartbeat_interval} s): a live trial "
                              "between two heartbeats would be taken for a dead one.",
                              f"set grace_period to {2 * self.heartbeat_interval} or more, or "
                              f"leave it out ({6 * self.heartbeat_interval}: 6 x the interval)")
        if not isinstance(self.max_retry, int) or self.max_retry < 0:
            raise ConfigError("study.max_retry", f"must be >= 0, got {self.max_retry!r}.",
                              "0 disables retries of trials left by a dead sweep")
        if self.direction not in ("minimize", "maximize"):
            raise ConfigError("study.direction", f"unknown direction {self.direction!r}.",
                              "use minimize or maximize")
        if not (callable(self.objective) or self.objective in OBJECTIVES or (
                isinstance(self.objective, str) and ":" in self.objective)):
            raise ConfigError("objective", f"unknown objective {self.objective!r}.",
                              f"use {' or '.join(OBJECTIVES)}, or 'module:fn' taking the "
                              "FitResult")
        if self.objective in ("final_eval_loss", "min_eval_loss") and \
                not self.base.get("eval_dataset") and "eval_dataset" not in self.params:
            raise ConfigError("objective", f"{self.objective} needs an evaluation set.",
                              "set base.eval_dataset (and eval_every), or use final_loss")
        self.objective_fn()
        job_fields = JobConfig.setting_names()
        for name in self.params:
            top = name.split(".")[0]
            if top in OWNED:
                raise ConfigError(f"params.{name}", f"{top} is set by the sweep for each trial.",
                                  "search another field")
            if top not in job_fields:
                raise ConfigError(f"params.{name}", f"{top} is not a job field.",
                                  f"use one of: {', '.join(job_fields)}")
        self._validate_enqueue()
        self._validate_timeout()
        self._validate_promotion()
        if self.scheduler is not None and (not isinstance(self.scheduler, str)
                                           or not self.scheduler.strip()):
            raise ConfigError("scheduler", f"must be a scheduler's name, got {self.scheduler!r}.",
                              "e.g. scheduler: default (`elastic scheduler start` runs one)")
        if self.storage is not None and not isinstance(self.storage, str):
            raise ConfigError("study.storage", "must be a SQLAlchemy URL string.",
                              "e.g. sqlite:///runs/sweep.db")
        for cfg in self.probe_configs():  # code differs between probes where it is searched
            cfg.model_factory()
            cfg.optimizer_factory()
            cfg.loss_fn()

    def _validate_enqueue(self) -> None:
        """Each ``enqueue`` point: a mapping of searched names to values in their space
        (``Param.check_value``), kept as the trials will get them. Was: only the names were
        checked; a value outside the space ended the sweep after Ray started, or ran."""
        if not isinstance(self.enqueue, list):
            raise ConfigError("enqueue", f"must be a list of points, got {self.enqueue!r}.",
                              "e.g. enqueue: [{optimizer.lr: 0.01}]")
        points = []
        for i, point in enumerate(self.enqueue):
            if not isinstance(point, dict):
                raise ConfigError(f"enqueue[{i}]", f"must be a mapping, got {point!r}.",
                                  "e.g. {optimizer.lr: 0.01, strategy: dp}")
            extra = sorted(set(point) - set(self.params))
            if extra:
                raise ConfigError(f"enqueue[{i}]", f"{extra[0]!r} is not a searched parameter.",
                                  f"use names from params: {', '.join(self.params)}")
            points.append({name: self.params[name].check_value(v, f"enqueue[{i}].{name}")
                           for name, v in point.items()})
        self.enqueue = points

    def _validate_timeout(self) -> None:
        """``timeout_s``: a finite number of seconds > 0; YAML's ``1e4`` (a string) is read as
        one. Was: not checked, and Optuna's optimize failed on it after Ray started."""
        v = self.timeout_s
        if v is None:
            return
        x = read_number(v)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (
                math.isfinite(x) and x > 0):
            raise ConfigError("timeout_s", f"must be a number of seconds > 0, got {v!r}.",
                              "e.g. timeout_s: 3600, or leave it out (no time limit)")
        self.timeout_s = float(x)

    def _validate_promotion(self) -> None:
        """``promotion: {growth: g}``: only with a pruner that promotes (hyperband), g >= 1,
        and a base job that may grow (``max_workers`` above ``num_workers``)."""
        g = self.promotion
        if g is None:
            return
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 1:
            raise ConfigError("promotion", f"growth must be a number >= 1, got {g!r}.",
                              "e.g. promotion: {growth: 2} (each rung passed doubles the "
                              "trial's workers, up to max_workers)")
        if self.scheduler is not None:
            raise ConfigError("promotion", "cannot be used with a scheduler: the scheduler "
                              "sizes every job it runs, trials included.",
                              "drop promotion, or run the sweep without --scheduler")
        if self.pruner.get("type", "median") != "hyperband":
            raise ConfigError("promotion", "needs a pruner that promotes trials.",
                              "set study.pruner: {type: hyperband, ...}, or drop promotion")
        top = self.base.get("max_workers")
        if not isinstance(top, int) or "max_workers" in self.params:
            raise ConfigError("promotion", "needs base.max_workers: the most workers a "
                              "promoted trial may grow to.",
                              "set base.max_workers (a fixed number, not searched)")

    def objective_fn(self) -> Callable[[Any], float]:
        """The trial's value from its ``FitResult``."""
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


def _exact_pruning(spec: Any) -> bool:
    """``pruning: {exact: true|false}`` (absent: false); ``ConfigError`` naming the field."""
    if spec is None:
        return False
    hint = ("pruning: {exact: true} pauses the trial's workers at each step where the pruner "
            "can decide (no step past the decision); omit it to train on (docs/sweeps.md)")
    if not isinstance(spec, dict):
        raise ConfigError("pruning", f"must be a mapping, got {spec!r}.", hint)
    extra = sorted(set(spec) - {"exact"})
    if extra:
        raise ConfigError(f"pruning.{extra[0]}", "is not a pruning setting.", "use: exact")
    exact = spec.get("exact", False)
    if not isinstance(exact, bool):
        raise ConfigError("pruning.exact", f"must be true or false, got {exact!r}.", hint)
    return exact


def check_arguments(name: str, fields: dict[str, Any]) -> None:
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


def child_uri(uri: str, name: str) -> str:
    """``uri`` with ``/name`` appended to its path (before any query string)."""
    head, sep, query = uri.partition("?")
    return f"{head.rstrip('/')}/{name}{sep}{query}"


def load_yaml(path: str, what: str) -> dict[str, Any]:
    """A YAML file's mapping; ``ConfigError`` naming ``what`` if it is missing or not one."""
    from ..config.yaml_file import load_mapping

    return load_mapping(path, what, "see docs/sweeps.md")
