"""Optuna's side of a sweep: the sampler, the pruner, the RDB storage and the study.

The study lives in the storage, so running a sweep again resumes it (``open_study``). A
seeded sampler is then seeded anew: rebuilt with the file's seed, its random start-up draws
would repeat the first run's (trial 6 = trial 4, ...). Optuna's own resume recipe keeps the
sampler's state by pickling the sampler to a file; elastic unpickles nothing, and a study in
a shared database has no single file beside it, so instead a resumed study's sampler gets the
seed ``resume_seed(seed, trials already in the study)``: new points, and still reproducible
(the same study resumed at the same point samples the same).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import optuna
from optuna.trial import TrialState

from ..errors import ConfigError
from .sweep_file import SweepConfig

__all__ = ["FINISHED", "make_sampler", "make_pruner", "make_storage", "open_study",
           "resume_seed", "trial_counts"]

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def _build(where: str, cls: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return cls(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(where, f"{cls.__name__} rejects {kwargs}: {e}",
                          "see the Optuna documentation of that class for its settings") from None


def resume_seed(seed: int, trials: int) -> int:
    """The sampler seed of a study resumed with ``trials`` trials in it: a function of both,
    so each resume point draws its own points, reproducibly."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(trials)]).generate_state(1)[0])


def make_sampler(cfg: SweepConfig, *, resumed_at: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of ``cfg``; ``resumed_at`` > 0 (trials already in the study) re-seeds a
    seeded one with ``resume_seed``. ``ConfigError`` for an unknown sampler or settings it
    rejects."""
    spec = dict(cfg.sampler)
    kind = spec.pop("type", "tpe")
    seed = spec.get("seed")
    if resumed_at > 0 and isinstance(seed, int) and not isinstance(seed, bool):
        spec["seed"] = resume_seed(seed, resumed_at)
    if kind == "grid":
        space = {n: p.grid() for n, p in cfg.params.items()}
        return _build("study.sampler", optuna.samplers.GridSampler, space, **spec)
    classes = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
    if kind not in classes:
        raise ConfigError("study.sampler", f"unknown sampler {kind!r}.",
                          "use tpe, random or grid")
    return _build("study.sampler", classes[kind], **spec)


def _check_hyperband(spec: dict[str, Any], from_max_steps: bool) -> None:
    """Optuna's HyperbandPruner takes any settings and then fails at its first decision,
    mid-sweep (a TypeError, a math domain error), or never prunes (max below min)."""
    def integer(key: str, least: int, also: str = "") -> None:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ConfigError(f"study.pruner.{key}", f"is {v!r}; Hyperband needs an integer "
                              f">= {least}.", f"set {key} to an integer >= {least}{also}")

    spec.setdefault("min_resource", 1)
    spec.setdefault("reduction_factor", 3)
    integer("min_resource", 1)
    integer("reduction_factor", 2)
    lo, hi = spec["min_resource"], spec["max_resource"]
    if hi == "auto":
        return
    if from_max_steps and isinstance(hi, int) and hi < lo:
        raise ConfigError("study.pruner.min_resource", f"is {lo}, above the base job's "
                          f"max_steps ({hi}, Hyperband's max_resource): it would never prune.",
                          "lower min_resource or raise max_steps")
    integer("max_resource", lo, " (min_resource) or 'auto'")


def make_pruner(cfg: SweepConfig) -> optuna.pruners.BasePruner:
    """The pruner of ``cfg``; ``ConfigError`` for an unknown pruner or settings it rejects."""
    spec = dict(cfg.pruner)
    kind = spec.pop("type", "median")
    if kind == "hyperband":
        spec.setdefault("max_resource", int(cfg.base.get("max_steps") or 0) or "auto")
        _check_hyperband(spec, from_max_steps="max_resource" not in cfg.pruner)
    classes = {"median": optuna.pruners.MedianPruner,
               "hyperband": optuna.pruners.HyperbandPruner, "none": optuna.pruners.NopPruner}
    if kind not in classes:
        raise ConfigError("study.pruner", f"unknown pruner {kind!r}.",
                          "use median, hyperband or none")
    return _build("study.pruner", classes[kind], **spec)


def make_storage(cfg: SweepConfig) -> optuna.storages.RDBStorage:
    """Open (and create) the RDB storage; an unreachable one is a ConfigError."""
    from sqlalchemy.engine import make_url

    url = cfg.storage_url
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
            retry = ({"heartbeat_stale_trial_callback": retry_cls(max_retry=cfg.max_retry)}
                     if retry_cls is not None else  # optuna < 4.9
                     {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(
                         max_retry=cfg.max_retry)})
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=cfg.heartbeat_interval,
                grace_period=cfg.grace_period or 6 * cfg.heartbeat_interval, **retry)
    except Exception as e:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError("study.storage", f"cannot open {shown}: {type(e).__name__}: {cause}",
                          "check that the database is up and reachable, that its driver is "
                          "installed (e.g. psycopg2 for postgresql://) and that the URL is "
                          "right") from None


def open_study(cfg: SweepConfig) -> optuna.Study:
    """Create the study, or load it if the storage has it (a resumed sweep: a seeded sampler
    is re-seeded, see the module docstring); queue ``enqueue``'s points and fail (and
    re-queue) the trials a dead sweep left running."""
    study = optuna.create_study(
        study_name=cfg.study_name, storage=make_storage(cfg), sampler=make_sampler(cfg),
        pruner=make_pruner(cfg),
        direction="maximize" if cfg.direction == "maximize" else "minimize",
        load_if_exists=True)
    if study.direction.name.lower() != cfg.direction:
        raise ConfigError("study.direction", f"the stored study {cfg.study_name!r} was "
                          f"created to {study.direction.name.lower()}.",
                          "use the same direction or another study name")
    existing = len(study.get_trials(deepcopy=False))
    if existing:
        study.sampler = make_sampler(cfg, resumed_at=existing)
    for point in cfg.enqueue:
        study.enqueue_trial(point, skip_if_exists=True)
    # Fail (and re-queue) what a dead sweep left RUNNING now, in one thread: Optuna also
    # does it as each trial starts, but concurrent trial threads can both fail the same
    # trial on SQLite (no row locks) and queue it twice.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """Trials per state, lower-case names: complete, pruned, fail, running, waiting."""
    out = {s.name.lower(): 0 for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] += 1
    return out
