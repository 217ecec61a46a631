"""The ``trackers`` setting: where a job's metrics, events and settings also go (TensorBoard,
MLflow, or a tracker class of the user's), checked when the config is built.

Accepted forms, normalised to a tuple of ``(kind, options)``:

    trackers: [tensorboard, mlflow]
    trackers: {tensorboard: {log_dir: tb}, mlflow: {experiment: sweeps, tracking_uri: ...}}
    trackers: [{mlflow: {experiment: x}}, {target: mypkg.trackers:WandbTracker, project: p}]

A ``target`` is ``module:Class``; the class is built on the controller with the other keys as
keyword arguments (``elastic.trackers`` says what it is called with).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from elastic.errors import ConfigError

from .checks import did_you_mean, text

__all__ = ["TRACKER_OPTIONS", "check_trackers"]

# kind -> the options it takes
TRACKER_OPTIONS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("log_dir",),
    "mlflow": ("tracking_uri", "experiment", "run_name", "tags", "artifact_location"),
}
_FIX = ("e.g. trackers: [tensorboard, mlflow], or trackers: {mlflow: {experiment: my-exp}}, "
        "or a class of yours: trackers: [{target: mypkg.mod:MyTracker}]")


def check_trackers(value: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The ``trackers`` setting, checked and normalised. Raises ``ConfigError``."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(t, tuple) and len(t) == 2 for t in value):
        value = list(value)  # already normalised (a section copied with ``set``)
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list):
        items = [_item(v, i) for i, v in enumerate(value)]
    else:
        raise ConfigError("trackers", f"must be a list of trackers or a mapping of tracker to "
                          f"options, got {type(value).__name__}.", _FIX)
    out = [_checked(kind, opts) for kind, opts in items]
    names = [k if k != "custom" else o["target"] for k, o in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError("trackers", f"names {dup} twice.", "give each tracker once")
    return tuple(out)


def _item(v: Any, i: int) -> tuple[Any, Any]:
    if isinstance(v, (str, tuple)):
        return v if isinstance(v, tuple) else (v, {})
    if isinstance(v, Mapping) and "target" in v:
        return "custom", dict(v)
    if isinstance(v, Mapping) and len(v) == 1:
        return next(iter(v.items()))
    raise ConfigError(f"trackers[{i}]", f"must be a tracker's name, {{name: options}} or "
                      f"{{target: module:Class, ...}}, got {v!r}.", _FIX)


def _checked(kind: Any, opts: Any) -> tuple[str, dict[str, Any]]:
    field = f"trackers.{kind}"
    if kind == "custom":
        target = opts.get("target")
        if not isinstance(target, str) or ":" not in target:
            raise ConfigError("trackers.target", f"must be 'module:Class', got {target!r}.",
                              "name the tracker class as module.path:ClassName")
        return "custom", dict(opts)
    if kind not in TRACKER_OPTIONS:
        near = did_you_mean(str(kind), TRACKER_OPTIONS)
        raise ConfigError(field, "is not a tracker.",
                          f"did you mean {near}?" if near else
                          f"use {', '.join(TRACKER_OPTIONS)}, or {{target: module:Class}}")
    if opts is None:
        opts = {}
    if not isinstance(opts, Mapping):
        raise ConfigError(field, f"takes a mapping of options, got {opts!r}.",
                          f"e.g. {kind}: {{{TRACKER_OPTIONS[kind][0]}: ...}}")
    for k in opts:
        if k not in TRACKER_OPTIONS[kind]:
            near = did_you_mean(str(k), TRACKER_OPTIONS[kind])
            raise ConfigError(f"{field}.{k}", f"is not an option of the {kind} tracker.",
                              f"did you mean {near}?" if near else
                              f"use {', '.join(TRACKER_OPTIONS[kind])}")
    for k in ("log_dir", "tracking_uri", "experiment", "run_name", "artifact_location"):
        text(opts.get(k), f"{field}.{k}")
    for k, fix in (("tracking_uri", "set MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment "
                    "instead"),
                   ("artifact_location", "give the store's credentials through the "
                    "environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the "
                    "store's own) instead")):
        uri = opts.get(k)  # (artifact_location's was written as given: config.json, params)
        if uri and (urlsplit(uri).password or urlsplit(uri).username):
            raise ConfigError(f"{field}.{k}", "carries credentials (user:password@), which "
                              "would be written to the run's logs.", fix)
    tags = opts.get("tags")
    if tags is not None and not (isinstance(tags, Mapping)
                                 and all(isinstance(k, str) for k in tags)):
        raise ConfigError(f"{field}.tags", f"must be a mapping of tag to value, got {tags!r}.",
                          "e.g. tags: {team: vision}")
    return str(kind), dict(opts)
