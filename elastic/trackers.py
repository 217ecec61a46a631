"""Trackers: a job's metrics, events and settings in the tools its users already watch
(TensorBoard, MLflow, or a class of theirs), set by ``trackers`` (``elastic.config.trackers``).

The controller writes them, once per job (not once per rank, and not from the training
loop), from the same history and events as ``metrics.jsonl`` and ``events.jsonl``: every
completed step once (a step run again after a restore is not logged twice), every event the
view shows, the job's settings (secrets redacted) and how it ended. Across a restore, a
resize or a strategy switch the tracker's run goes on: it belongs to the job, not to a group
of workers. A resumed job in the same run directory (``resume`` set) goes on with the same
tracker runs: each tracker's ``state()`` (MLflow: its run id; TensorBoard: its directory) and
the last step it logged are kept in ``<run dir>/trackers.json``, handed back as
``RunInfo.resumed``, and the steps it logged already are not sent again (TensorBoard instead
purges from the resumed job's first step and is sent every step). A tracker that starts a
run of its own instead (its state differs) is sent every step.

Each tracker runs on a thread of its own, so a slow or unreachable tracker never holds up
the controller, and its failures never stop the job: a failed call is tried again twice
(after 1 and 2 s), and a third failure in a row turns that tracker off for the rest of the
job; each is said as a ``tracker_failed`` event, and the run directory's logs stay complete.
At the end the job waits up to ``CLOSE_S`` for the trackers to flush.

A tracker class of the user's (``trackers: [{target: mypkg.mod:MyTracker, ...}]``) is built
with the other keys as keyword arguments and implements ``Tracker``'s four methods.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checkpoint.location import shown_uri
from .errors import ConfigError
from .events import Event
from .view import View

__all__ = ["Tracker", "RunInfo", "TensorBoardTracker", "MlflowTracker", "TrackerView",
           "check_trackers_here", "with_trackers", "METRIC_KEYS", "CLOSE_S"]

CLOSE_S = 30.0  # the end of a job waits this long, at most, for its trackers to flush
RETRY_S = (1.0, 2.0)  # a failed call is tried again after these waits; then the tracker is off
# the numbers of a step's history entry (metrics.jsonl) that go to the trackers
METRIC_KEYS = ("loss", "eval_loss", "lr", "grad_norm", "samples_per_s", "step_time",
               "world_size", "generation", "skipped")


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is told at the start: the job's name, run directory, steps, and its
    settings under their flat names (``JobConfig.to_dict``: secrets redacted)."""

    job: str
    run_dir: str
    max_steps: int
    config: dict[str, Any]
    resumed: dict[str, Any] | None = None  # this tracker's state() in the job this resumes
    resumed_after: int = -1  # the last step it logged then


class Tracker:
    """Base of the trackers. Each method runs on the tracker's own thread, in order."""

    def start(self, run: RunInfo) -> str | None:
        """Open the tracker's run. Returns where the data goes (said in an event), or None."""
        return None

    def log_steps(self, entries: list[dict[str, Any]]) -> None:
        """Completed steps, in order: ``step`` (as in metrics.jsonl), ``time`` (Unix
        seconds) and the numbers of ``METRIC_KEYS`` the step has (a step completed while a
        worker was lost, with a ``note``: ``samples_per_s`` and ``step_time`` None, and a
        NaN ``loss``: none was measured). Once it returns they count as kept: a resumed job
        does not send them again."""

    def log_events(self, events: list[Event]) -> None:
        """Events, in order (``kind``, ``message``, ``step``, ``time``, ``data``)."""

    def finish(self, status: str) -> None:
        """The job ended: ``finished``, ``failed`` or ``interrupted``."""

    resends = False  # True: a resumed job sends it every step it runs, the replayed too

    def state(self) -> dict[str, Any]:
        """What a resumed job needs to go on with this run (JSON), read after ``start``.
        Another state after a resumed ``start`` means a run of its own: every step is sent."""
        return {}


def _numbers(entry: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k in METRIC_KEYS:
        v = entry.get(k)
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


class TensorBoardTracker(Tracker):
    """Scalars per step (``loss``, ``samples_per_s``, ...), events as text (tag
    ``events``), the settings as text (tag ``config``), in ``log_dir`` (default
    ``<run dir>/tensorboard``). Written with tensorboardX (installed with Ray Train).

    A resumed job writes a new event file in the same directory that starts with
    TensorBoard's purge (``purge_step``: the first step the resumed job completes), so the
    earlier file's steps from there on, whether they reached the disk or not, are replaced
    by the resumed job's: it is sent every step it runs (``resends``)."""

    resends = True

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self._w: Any = None
        self._run: RunInfo | None = None
        self._held: list[Event] = []  # a resumed job's events before its first step

    def start(self, run: RunInfo) -> str:
        self.log_dir = os.path.abspath(self.log_dir or os.path.join(run.run_dir, "tensorboard"))
        self._run = run
        if run.resumed is None:
            self._open(None)
        return f"tensorboard: {self.log_dir}"

    def _open(self, purge_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        assert self._run is not None
        # flushed each second (a driver that dies loses ~1 s of points, not 10 s); the
        # suffix keeps a resumed job's file from taking the name (time in s) of the last one
        self._w = SummaryWriter(self.log_dir, flush_secs=1, purge_step=purge_step,
                                filename_suffix=f".{time.time_ns()}")
        self._w.add_text("config", "```\n" + json.dumps(self._run.config, indent=1,
                                                         default=str) + "\n```",
                         purge_step or 0)
        held, self._held = self._held, []
        self.log_events(held)

    def state(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def log_steps(self, entries: list[dict[str, Any]]) -> None:
        if self._w is None:
            self._open(entries[0]["step"])
        for e in entries:
            for k, v in _numbers(e).items():
                self._w.add_scalar(k, v, e["step"], walltime=e.get("time"))

    def log_events(self, events: list[Event]) -> None:
        if self._w is None:
            self._held += events
            return
        for ev in events:
            self._w.add_text("events", f"**{ev.kind}**: {ev.message}", ev.step or 0,
                             walltime=ev.time)

    def finish(self, status: str) -> None:
        if self._w is None:
            self._open(None)
        self._w.add_text("status", status, 0)
        self._w.close()


class MlflowTracker(Tracker):
    """One MLflow run per job (named after it, tagged ``elastic.job``, ``elastic.run_dir``):
    the settings as params, each step's numbers as metrics at its step, the events as the
    artifact ``elastic/events.txt``, and the end as the run's status (FINISHED, FAILED,
    KILLED). An experiment this creates keeps its artifacts at ``artifact_location``
    (MLflow's default otherwise: ``./mlruns`` for a database store). ``tracking_uri`` defaults to MLflow's own (``MLFLOW_TRACKING_URI``),
    ``experiment`` to ``MLFLOW_EXPERIMENT_NAME``, else MLflow's default experiment; the
    credentials come from MLflow's environment variables, never from the job's settings."""

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None,
                 run_name: str | None = None, tags: dict[str, Any] | None = None,
                 artifact_location: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location  # of an experiment this creates
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._c: Any = None
        self._events: list[str] = []
        self._written = time.monotonic()  # when the events' artifact was last written

    def start(self, run: RunInfo) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._c = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        exp = self._c.get_experiment_by_name(name)
        if exp is None:
            try:
                eid = self._c.create_experiment(name, self.artifact_location)
            except Exception:  # noqa: BLE001 - another job created it meanwhile
                exp = self._c.get_experiment_by_name(name)
                if exp is None:
                    raise
                eid = exp.experiment_id
        else:
            eid = exp.experiment_id
        tags = {"elastic.job": run.job, "elastic.run_dir": run.run_dir,
                **{str(k): str(v) for k, v in self.tags.items()}}
        had = self._go_on(run, eid)
        went_on = had is not None
        if had is None:
            if self.run_id is None:  # (a start tried again: the run it made, not another)
                r = self._c.create_run(eid, run_name=self.run_name or run.job, tags=tags)
                self.run_id = r.info.run_id
            had = {}
        params = [Param(k, _param_text(v)) for k, v in sorted(run.config.items())
                  if k not in had]  # a param's value cannot change in MLflow
        changed = [f"{k}: {had[k]} -> {_param_text(v)}" for k, v in sorted(run.config.items())
                   if k in had and had[k] != _param_text(v)]
        said = f"step {run.resumed_after + 1}: settings: resumed with " + "; ".join(changed)
        if changed and said not in self._events:  # (once, a start tried again too)
            self._events.append(said)
        for i in range(0, len(params), 100):  # MLflow takes 100 params a call
            self._c.log_batch(self.run_id, params=params[i:i + 100])
        how = "continued (the job resumed) " if went_on else ""
        return (f"mlflow: run {self.run_id} {how}in experiment {name!r} at "
                f"{shown_uri(str(self._c.tracking_uri))}")  # (no user:password@)

    def _go_on(self, run: RunInfo, eid: str) -> dict[str, str] | None:
        """The resumed job's run, RUNNING again, with its params and its events so far (the
        artifact is written whole at the end); None when there is none to go on with (not
        resumed, or the run is gone from this server or experiment)."""
        rid = (run.resumed or {}).get("run_id")
        if not rid:
            return None
        from mlflow.exceptions import MlflowException

        try:
            r = self._c.get_run(rid)
        except MlflowException as e:  # gone (another server, or deleted): a run of its own;
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":  # anything else is tried again
                raise
            return None
        if r.info.experiment_id != eid or r.info.lifecycle_stage != "active":
            return None
        self.run_id = rid
        self._c.update_run(rid, status="RUNNING")
        names = {a.path for a in self._c.list_artifacts(rid, os.path.dirname(EVENTS_TXT))}
        if EVENTS_TXT in names:  # (none: the earlier job ended before it wrote them)
            with tempfile.TemporaryDirectory() as d:
                with open(self._c.download_artifacts(rid, EVENTS_TXT, d)) as f:
                    self._events = f.read().splitlines()
        return dict(r.data.params)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def log_steps(self, entries: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, int(1000 * (e.get("time") or time.time())), int(e["step"]))
                   for e in entries for k, v in _numbers(e).items()]
        for i in range(0, len(metrics), 1000):  # and 1000 metrics
            self._c.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_events(self, events: list[Event]) -> None:
        self._events += [f"step {ev.step}: {ev.kind}: {ev.message}" for ev in events]
        if time.monotonic() - self._written >= EVENTS_EVERY_S:  # (a driver killed before
            self._write_events()  # its end leaves those up to its last write: the events
            # that came within a minute of one wait for the next event, or the end)

    def _write_events(self) -> None:
        self._written = time.monotonic()
        self._c.log_text(self.run_id, "\n".join(self._events) + "\n", EVENTS_TXT)

    def finish(self, status: str) -> None:
        if self._events:
            self._write_events()
        self._c.set_terminated(self.run_id, {"finished": "FINISHED",
                                             "interrupted": "KILLED"}.get(status, "FAILED"))


EVENTS_TXT = "elastic/events.txt"  # the MLflow run's artifact of the job's events
EVENTS_EVERY_S = 60.0  # how often it is written again while events come (and at the end)


def _param_text(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text[:6000]  # MLflow's limit for a param's value


_BUILT_IN: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoardTracker,
                                                "mlflow": MlflowTracker}


def _factory(kind: str, opts: dict[str, Any]) -> Callable[[], Any]:
    if kind == "custom":
        from .config.code import resolve_callable

        cls = resolve_callable(opts["target"], "trackers.target")
        kw = {k: v for k, v in opts.items() if k != "target"}
        return lambda: cls(**kw)
    return lambda: _BUILT_IN[kind](**opts)


def check_trackers_here(trackers: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    """Preflight, on the controller's machine: each tracker's code is there. Raises
    ``ConfigError`` naming the tracker and the fix."""
    for kind, opts in trackers:
        if kind == "mlflow" and importlib.util.find_spec("mlflow") is None:
            raise ConfigError("trackers.mlflow", "needs the mlflow package, which is not "
                              "installed where the job's controller runs.",
                              "pip install mlflow-skinny (or mlflow), or drop the tracker")
        if kind == "tensorboard" and importlib.util.find_spec("tensorboardX") is None:
            raise ConfigError("trackers.tensorboard", "needs tensorboardX, which is not "
                              "installed here.", "pip install tensorboardX")
        if kind == "custom":  # its class, and its options against its signature (was:
            # a misspelled one found when the job started it: turned off, the job went on)
            from .config.code import check_keywords, resolve_callable

            cls = resolve_callable(opts["target"], "trackers.target")
            check_keywords("trackers", cls, {k: v for k, v in opts.items() if k != "target"},
                           complete=True)


def _resumed(run: RunInfo, had: Any) -> RunInfo:
    """``run`` with a tracker's saved row (a resumed job's); ``run`` itself for none, or a
    row that is not one (a file edited or cut short: that tracker starts a run of its own)."""
    try:
        state, last = had["state"], int(had["last_step"])
    except (TypeError, KeyError, ValueError):
        return run
    return dataclasses.replace(run, resumed=state, resumed_after=last) \
        if isinstance(state, dict) else run


class _Saved:
    """``<run dir>/trackers.json``: each tracker's ``state()`` and the last step it logged,
    by name (and which of that name), for a resumed job; rows of trackers that did not
    start are kept. Written whole (a rename) by the trackers'
    threads."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, "trackers.json")
        self.rows: dict[str, Any] = {}
        self._lock = threading.Lock()

    def load(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                got = json.load(f)
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def put(self, key: str, state: dict[str, Any], last_step: int) -> None:
        with self._lock:
            self.rows[key] = {"state": state, "last_step": last_step}
            tmp = f"{self.path}.{threading.get_ident()}.tmp"
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(tmp, "w") as f:
                    json.dump(self.rows, f, default=str)
                os.replace(tmp, self.path)
            except OSError:  # a resumed job then starts new tracker runs: nothing is lost
                pass


class _Runner:
    """One tracker on a thread of its own: calls in order, batched, retried, then off."""

    def __init__(self, name: str, make: Callable[[], Any], notes: list[tuple[str, str]],
                 lock: threading.Lock, saved: _Saved | None = None, key: str = "") -> None:
        self.name = name
        self._make = make
        self._notes, self._lock = notes, lock
        self._saved, self._key = saved, key
        self._floor = -1  # the last step this tracker's run holds (a resumed job's)
        self._state: dict[str, Any] = {}
        self._tracker: Any = None  # made once: a start tried again goes on with it
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.off = False
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"elastic-tracker-{name}")
        self.thread.start()

    def put(self, op: str, arg: Any) -> None:
        if not self.off or op == "finish":  # (the thread ends at its finish)
            self._q.put((op, arg))

    def _note(self, kind: str, message: str) -> None:
        with self._lock:
            self._notes.append((kind, message))

    def _serve(self) -> None:
        tracker: Any = None
        while True:
            op, arg = self._q.get()
            if op in ("steps", "events"):  # what queued meanwhile goes in one call
                while True:
                    try:
                        nxt = self._q.queue[0]
                    except IndexError:
                        break
                    if nxt[0] != op:
                        break
                    arg = arg + self._q.get()[1]
            if self.off:
                if op == "finish":
                    return
                continue
            if op == "steps":
                arg = [e for e in arg if e["step"] > self._floor]
                if not arg:
                    continue
            if op == "start":
                call: Callable[[], Any] = functools.partial(self._start, arg)
            else:
                method = {"steps": "log_steps", "events": "log_events", "finish": "finish"}[op]
                call = functools.partial(getattr(tracker, method), arg)
            out = self._call(op, call)
            if op == "start" and not self.off:
                tracker = out
            if op == "steps" and not self.off:  # written after each call that logged:
                self._floor = arg[-1]["step"]  # a small file beside a tracker call that is
                self._save()  # I/O itself; less often, a resume would send steps twice
            if op == "finish":
                return

    def _start(self, run: RunInfo) -> Any:
        if self._tracker is None:  # (was: one per try: an MLflow run each, left RUNNING)
            self._tracker = self._make()
        tracker = self._tracker
        where = tracker.start(run)
        state: Any = getattr(tracker, "state", dict)()  # (a user's class may have none)
        self._state = dict(state) if isinstance(state, dict) else {}
        if (self._state and self._state == run.resumed  # the same run, on (a tracker
                and not getattr(tracker, "resends", False)):  # that keeps no state: new)
            self._floor = run.resumed_after
        self._save()
        if where:
            self._note("tracker", str(where))
        return tracker

    def _save(self) -> None:
        if self._saved is not None:
            self._saved.put(self._key, self._state, self._floor)

    def _call(self, op: str, call: Callable[[], Any]) -> Any:
        for attempt in range(len(RETRY_S) + 1):
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - a tracker never stops the job
                why = f"{type(e).__name__}: {str(e)[:300]}"
                if attempt < len(RETRY_S):
                    self._note("tracker_failed", f"{self.name}: {op} failed ({why}); trying "
                               f"again in {RETRY_S[attempt]:g} s")
                    time.sleep(RETRY_S[attempt])
                else:
                    self.off = True
                    self._note("tracker_failed", f"{self.name}: {op} failed {attempt + 1} "
                               f"times ({why}); the tracker is off for the rest of the job "
                               "(the run directory's logs have everything)")
        return None


class TrackerView(View):
    """The job's view with its trackers beside it: what the view is shown, each tracker is
    sent (steps once each, in order; events but the state transitions). Trackers start at
    the view's ``start`` (the run directory exists then) and are flushed and closed at
    ``close``. ``bind(emit)``: their notes (where the data goes, failures) become events,
    said on the controller's thread."""

    def __init__(self, inner: View, cfg: Any) -> None:
        self.inner = inner
        self.cfg = cfg
        self._emit: Callable[..., Any] | None = None
        self._runners: list[_Runner] = []
        self._notes: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._logged = -1  # the last step sent
        self._status = "failed"  # until the job says it finished
        self._closing = False
        self._early: list[Event] | None = []  # events before ``start``: sent at it

    def bind(self, emit: Callable[..., Any]) -> None:
        self._emit = emit

    def start(self, job: str, max_steps: int) -> None:
        self.inner.start(job, max_steps)
        run = RunInfo(job, os.path.abspath(self.cfg.run_path), max_steps, self.cfg.to_dict())
        saved = _Saved(run.run_dir)
        prior = saved.load() if self.cfg.resume else {}  # a resumed job in this run dir
        saved.rows.update(prior)  # a tracker that does not start now keeps its row
        seen: dict[str, int] = {}
        for kind, opts in self.cfg.trackers:
            name = kind if kind != "custom" else opts["target"]
            seen[name] = seen.get(name, 0) + 1
            key = f"{name}#{seen[name]}"  # (not by position: adding a tracker moves none)
            r = _Runner(name, _factory(kind, opts), self._notes, self._lock, saved, key)
            r.put("start", _resumed(run, prior.get(key)))
            self._runners.append(r)
        early, self._early = self._early or [], None  # (the fork, the cluster, the claim:
        if early:  # said while the job started, before its run directory)
            for r in self._runners:
                r.put("events", list(early))

    def workers(self, infos: list[dict[str, Any]]) -> None:
        self.inner.workers(infos)

    def step(self, entry: dict[str, Any]) -> None:
        self.inner.step(entry)
        if entry["step"] > self._logged:
            self._logged = entry["step"]
            for r in self._runners:
                r.put("steps", [dict(entry)])
        self._say()

    def event(self, ev: Event) -> None:
        self.inner.event(ev)
        if ev.kind in ("finished", "failed", "interrupted") and self._status != "interrupted":
            self._status = ev.kind
        if self._early is not None and not ev.kind.startswith("tracker"):
            self._early.append(ev)  # not started yet
        elif not self._closing and not ev.kind.startswith("tracker"):
            for r in self._runners:
                r.put("events", [ev])
        self._say()

    def _say(self) -> None:
        if self._emit is None or not self._notes:
            return
        with self._lock:
            notes, self._notes[:] = list(self._notes), []
        for kind, message in notes:
            self._emit(kind, message)

    def close(self) -> None:
        self._closing = True
        for r in self._runners:
            r.put("finish", self._status)
        deadline = time.monotonic() + CLOSE_S
        for r in self._runners:
            r.thread.join(max(0.0, deadline - time.monotonic()))
            if r.thread.is_alive():
                with self._lock:
                    self._notes.append(("tracker_failed", f"{r.name}: not flushed within "
                                        f"{CLOSE_S:g} s of the end; its last data may be "
                                        "missing (the run directory's logs have it)"))
        self._say()
        self.inner.close()


def with_trackers(view: View, cfg: Any) -> View:
    """``view``, with the job's trackers beside it when it has any."""
    return TrackerView(view, cfg) if cfg.trackers else view

