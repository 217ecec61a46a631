"""Trackers without Ray: the ``trackers`` setting's forms and errors, what ``TrackerView``
sends each tracker (steps once, events, the end), that a failing or hanging tracker never
stops or holds up the job, and TensorBoard's files read back."""

from __future__ import annotations

import glob
import os
import struct
import time
from typing import Any

import pytest

from elastic.config import JobConfig
from elastic.errors import ConfigError
from elastic.events import Event
from elastic.view import View
from tests.helpers import RegressionData, adam, mlp, mse

SEEN: dict[str, list[Any]] = {}  # what each Recording tracker was sent, by its name


class Recording:
    """A tracker of "the user's" (``target: tests.unit.test_trackers:Recording``)."""

    def __init__(self, name: str = "rec", fail: str | None = None, times: int = 0,
                 hang: float = 0.0) -> None:
        self.name, self.fail, self.times, self.hang = name, fail, times, hang
        SEEN[name] = []

    def _maybe_fail(self, op: str) -> None:
        if self.fail == op and self.times != 0:
            self.times -= 1
            raise ConnectionError(f"{op}: tracking server unreachable")

    def start(self, run):
        self._maybe_fail("start")
        SEEN[self.name].append(("start", run.job, run.config["global_batch_size"]))
        return f"rec: {self.name}"

    def log_steps(self, entries):
        self._maybe_fail("steps")
        SEEN[self.name].extend(("step", e["step"], e["loss"]) for e in entries)

    def log_events(self, events):
        SEEN[self.name].extend(("event", ev.kind) for ev in events)

    def finish(self, status):
        time.sleep(self.hang)
        SEEN[self.name].append(("finish", status))


def _cfg(tmp_path, trackers) -> JobConfig:
    return JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                     global_batch_size=4, max_steps=10, run_dir=str(tmp_path / "run"),
                     trackers=trackers)


def test_the_setting_takes_names_options_and_classes_in_either_form(tmp_path):
    c = _cfg(tmp_path, ["tensorboard", {"mlflow": {"experiment": "e"}},
                        {"target": "tests.unit.test_trackers:Recording", "name": "a"}])
    assert c.trackers == (("tensorboard", {}), ("mlflow", {"experiment": "e"}),
                          ("custom", {"target": "tests.unit.test_trackers:Recording",
                                      "name": "a"}))
    assert _cfg(tmp_path, {"tensorboard": None, "mlflow": {"tags": {"t": 1}}}).trackers == (
        ("tensorboard", {}), ("mlflow", {"tags": {"t": 1}}))
    assert _cfg(tmp_path, "tensorboard").trackers == (("tensorboard", {}),)
    assert c.replace(max_steps=5).trackers == c.trackers  # a checked copy keeps them
    assert c.to_dict()["trackers"][1] == {"mlflow": {"experiment": "e"}}
    nested = JobConfig.from_dict({
        "model": "tests.helpers:mlp", "optimizer": {"name": "adam"}, "loss": "mse",
        "dataset": {"target": "tests.helpers:RegressionData"}, "global_batch_size": 4,
        "max_steps": 2, "output": {"trackers": ["tensorboard"]}})
    assert nested.trackers == (("tensorboard", {}),)
    assert _cfg(tmp_path, None).trackers == ()


@pytest.mark.parametrize("bad, field, says", [
    ("tensorbord", "trackers.tensorbord", "did you mean tensorboard?"),
    ({"mlflow": {"experimnt": "x"}}, "trackers.mlflow.experimnt", "did you mean experiment?"),
    ({"mlflow": {"tracking_uri": "https://me:tok@mlflow.example"}},
     "trackers.mlflow.tracking_uri", "MLFLOW_TRACKING_PASSWORD"),
    ({"mlflow": {"artifact_location": "s3://AKIAX:ARTSECRET1@bucket/mlruns"}},  # (was:
     "trackers.mlflow.artifact_location", "AWS_ACCESS_KEY_ID"),  # written as given)
    ({"mlflow": "x"}, "trackers.mlflow", "takes a mapping of options"),
    ({"mlflow": {"tags": ["a"]}}, "trackers.mlflow.tags", "mapping of tag to value"),
    ({"tensorboard": {"log_dir": 3}}, "trackers.tensorboard.log_dir", "non-empty string"),
    (["tensorboard", "tensorboard"], "trackers", "twice"),
    ([{"target": "nocolon"}], "trackers.target", "module:Class"),
    ([3], "trackers[0]", "tracker's name"),
    (5, "trackers", "must be a list of trackers"),
])
def test_a_bad_setting_is_one_clear_error_naming_the_field(tmp_path, bad, field, says):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, bad)
    assert e.value.field == field and says in str(e.value)


def test_the_controllers_machine_must_have_the_trackers_code(tmp_path, monkeypatch):
    """Preflight (before any worker starts): a tracker class that does not import, or
    MLflow not installed, is a ConfigError with the fix."""
    import importlib.util

    from elastic.trackers import check_trackers_here

    with pytest.raises(ConfigError, match="cannot import"):
        check_trackers_here((("custom", {"target": "no_such_mod:T"}),))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install mlflow-skinny") as e:
        check_trackers_here((("mlflow", {}),))
    assert e.value.field == "trackers.mlflow"


def _view(tmp_path, monkeypatch, **opts):
    from elastic import trackers

    monkeypatch.setattr(trackers, "RETRY_S", (0.0, 0.0))
    cfg = _cfg(tmp_path, [{"target": "tests.unit.test_trackers:Recording", **opts}])
    cfg.run_dir = str(tmp_path / "run")
    said: list[tuple[str, str]] = []
    v = trackers.TrackerView(View(), cfg)
    v.bind(lambda kind, msg, **kw: said.append((kind, msg)) or v.event(Event(kind, msg)))
    return v, said


def _entry(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 1.0 / (step + 1), "samples_per_s": 10.0, "step_time": 0.1,
            "world_size": 2, "strategy": "dp", "time": 1e9 + step, "generation": 1}


def _wait(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def test_each_step_goes_once_with_the_events_and_the_end(tmp_path, monkeypatch):
    """A step run again after a restore is not sent twice; events go but the trackers' own;
    the end is the job's (an interrupted job's finish is still an interruption)."""
    v, said = _view(tmp_path, monkeypatch, name="once")
    v.start("job-a", 10)
    for s in (0, 1, 2, 1, 2, 3):  # steps 1 and 2 run again after a restore
        v.step(_entry(s))
    v.event(Event("recovered", "from peers", step=2))
    v.event(Event("interrupted", "SIGTERM received", step=3))
    v.event(Event("finished", "10 steps", step=3))
    v.close()
    seen = SEEN["once"]
    assert seen[0] == ("start", "job-a", 4)
    assert [x[1] for x in seen if x[0] == "step"] == [0, 1, 2, 3]
    assert [x[1] for x in seen if x[0] == "event"] == ["recovered", "interrupted", "finished"]
    assert seen[-1] == ("finish", "interrupted")
    assert said == [("tracker", "rec: once")]  # where the data goes, as an event


def test_events_said_before_the_trackers_start_reach_them(tmp_path, monkeypatch):
    """The controller says some events while the job starts, before the view's ``start``
    (its run directory): a fork, the cluster attached, the checkpoint URI claimed. They go
    to the trackers when they start, first. Was: never sent (found by review)."""
    v, _ = _view(tmp_path, monkeypatch, name="early")
    v.event(Event("forked", "from s3://b/run step 10"))
    v.event(Event("cluster", "attached to 127.0.0.1:6379"))
    v.start("job-e", 10)
    v.event(Event("placed", "2 workers"))
    v.close()
    assert [x[1] for x in SEEN["early"] if x[0] == "event"] == ["forked", "cluster", "placed"]


def test_a_failing_tracker_is_tried_again_then_turned_off_and_the_job_goes_on(
        tmp_path, monkeypatch):
    v, said = _view(tmp_path, monkeypatch, name="flaky", fail="steps", times=1)
    v.start("job-b", 10)
    v.step(_entry(0))
    _wait(lambda: ("step", 0, 1.0) in SEEN.get("flaky", []))  # the second try went through
    v.close()
    assert SEEN["flaky"][-1] == ("finish", "failed")  # no "finished" event: not finished
    assert [k for k, _ in said] == ["tracker", "tracker_failed"]

    v, said = _view(tmp_path, monkeypatch, name="down", fail="steps", times=-1)
    v.start("job-c", 10)
    for s in range(3):
        v.step(_entry(s))
    v.event(Event("finished", "3 steps"))
    t0 = time.monotonic()
    v.close()
    assert time.monotonic() - t0 < 5
    fails = [m for k, m in said if k == "tracker_failed"]
    assert "off for the rest of the job" in fails[-1] and "unreachable" in fails[-1]
    assert not [x for x in SEEN["down"] if x[0] in ("step", "finish")]  # off: nothing more


def test_a_tracker_that_does_not_start_is_off_and_says_why(tmp_path, monkeypatch):
    v, said = _view(tmp_path, monkeypatch, name="nostart", fail="start", times=-1)
    v.start("job-d", 10)
    v.step(_entry(0))
    v.close()
    assert SEEN["nostart"] == []
    assert said[-1][0] == "tracker_failed" and "start failed 3 times" in said[-1][1]


def test_the_end_of_a_job_waits_for_a_slow_tracker_only_so_long(tmp_path, monkeypatch):
    from elastic import trackers

    monkeypatch.setattr(trackers, "CLOSE_S", 0.3)
    v, said = _view(tmp_path, monkeypatch, name="slow", hang=3.0)
    v.start("job-e", 10)
    t0 = time.monotonic()
    v.close()
    assert time.monotonic() - t0 < 2
    assert said[-1][0] == "tracker_failed" and "not flushed within 0.3 s" in said[-1][1]


def _tb_records(log_dir: str) -> list[tuple[int, str, Any]]:
    """(step, tag, value) of every summary in ``log_dir``'s event files (TFRecord framing:
    length, its CRC, the Event protobuf, its CRC), files in the order they were made, as
    TensorBoard reads them: a session START at step s (``purge_step``) drops what came
    before it at step s or later."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                out = [r for r in out if r[0] < ev.step]
            for val in ev.summary.value:
                out.append((ev.step, val.tag, val.simple_value if val.HasField("simple_value")
                            else val.tensor.string_val[0].decode()))
    return out


def test_tensorboard_gets_the_steps_numbers_events_and_settings(tmp_path, monkeypatch):
    from elastic import trackers

    cfg = _cfg(tmp_path, ["tensorboard"])
    cfg.run_dir = str(tmp_path / "run")
    v = trackers.TrackerView(View(), cfg)
    v.bind(lambda *a, **kw: None)
    v.start("job-tb", 10)
    for s in range(3):
        v.step(dict(_entry(s), lr=0.1, skipped=s == 2))
    v.event(Event("switched", "dp -> zero2", step=1))
    v.event(Event("finished", "3 steps", step=2))
    v.close()
    recs = _tb_records(str(tmp_path / "run" / "tensorboard"))
    loss = [(s, round(x, 6)) for s, tag, x in recs if tag == "loss"]
    assert loss == [(0, 1.0), (1, 0.5), (2, round(1 / 3, 6))]
    assert [x for s, tag, x in recs if tag == "skipped"] == [0.0, 0.0, 1.0]
    assert {"samples_per_s", "step_time", "world_size", "lr", "generation"} <= {
        tag for _, tag, _ in recs}
    texts = {tag: x for _, tag, x in recs if tag.endswith("text_summary")}
    assert "**switched**: dp -> zero2" in [x for _, tag, x in recs if tag.startswith("events")]
    assert '"global_batch_size": 4' in texts["config/text_summary"]
    assert texts["status/text_summary"] == "finished"


def test_the_view_is_untouched_without_trackers(tmp_path):
    from elastic.trackers import with_trackers

    inner = View()
    assert with_trackers(inner, _cfg(tmp_path, None)) is inner


def _job_view(tmp_path, trackers_setting, resume: str | None):
    from elastic import trackers

    cfg = _cfg(tmp_path, trackers_setting)
    cfg.run_dir = str(tmp_path / "run")
    cfg.resume = resume
    v = trackers.TrackerView(View(), cfg)
    said: list[tuple[str, str]] = []
    v.bind(lambda kind, msg, **kw: said.append((kind, msg)))
    return v, said


def _logged_through(tmp_path, step: int, trackers: int) -> None:
    """Until the run dir's ``trackers`` trackers each say they logged ``step``."""
    import json

    def done() -> bool:
        try:
            with open(tmp_path / "run" / "trackers.json") as f:
                rows = json.load(f)
        except (OSError, ValueError):
            return False
        return len(rows) == trackers and all(r["last_step"] >= step for r in rows.values())
    _wait(done)


def test_a_resumed_job_goes_on_with_its_trackers_runs_and_logs_each_step_once(tmp_path):
    """The first job's driver dies after step 7 (no end: its MLflow run is left RUNNING,
    TensorBoard's last steps may not be on disk); the job is resumed in the same run dir from
    its step-4 checkpoint, so steps 4-7 run again. One MLflow run, FINISHED, each step once
    (the first time: MLflow cannot replace a point); one TensorBoard curve, each step once
    (the resumed job's from step 4: TensorBoard purges). A setting that changed at the
    resume is said, not refused by MLflow."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    setting = ["tensorboard", {"mlflow": {"tracking_uri": uri, "experiment": "resumes",
                                          "artifact_location": str(tmp_path / "art")}}]
    first, said1 = _job_view(tmp_path, setting, None)
    first.start("job-r", 12)
    for s in range(8):
        first.step(_entry(s))
    _logged_through(tmp_path, 7, 2)
    _wait(lambda: (7, "loss") in [r[:2] for r in _tb_records(str(tmp_path / "run" /
                                                                 "tensorboard"))])
    # and then the driver is gone: no close()

    second, said2 = _job_view(tmp_path, setting, "latest")
    second.start("job-r", 12)
    for s in range(4, 12):
        second.step(dict(_entry(s), loss=5.0 + s))  # a replayed step's numbers differ: not sent
    second.event(Event("finished", "12 steps", step=11))
    second.close()

    c = MlflowClient(tracking_uri=uri)
    (run,) = c.search_runs([c.get_experiment_by_name("resumes").experiment_id])
    assert run.info.status == "FINISHED"
    hist = sorted(c.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in hist] == [(s, 1.0 / (s + 1)) for s in range(8)] + [
        (s, 5.0 + s) for s in range(8, 12)]
    assert run.data.params["resume"] == "null"  # MLflow keeps the first value ...
    events = c.download_artifacts(run.info.run_id, "elastic/events.txt", str(tmp_path / "dl"))
    with open(events) as f:
        text = f.read()
    assert "settings: resumed with resume: null -> latest" in text  # ... and the change is said
    assert ": finished: 12 steps" in text
    where = [m for k, m in said2 if k == "tracker"]
    assert any(f"run {run.info.run_id} continued (the job resumed)" in m for m in where)

    tb = [(s, round(x, 6)) for s, tag, x in _tb_records(str(tmp_path / "run" / "tensorboard"))
          if tag == "loss"]
    # TensorBoard: the resumed job's steps from its first (4) on replace the first job's
    assert sorted(tb) == [(s, round(1.0 / (s + 1), 6)) for s in range(4)] + [
        (s, 5.0 + s) for s in range(4, 12)]


def test_a_resumed_job_whose_tracker_run_is_gone_starts_one_and_sends_it_every_step(tmp_path):
    """The first job's MLflow run was deleted: the resumed job's run is a new one, and it
    gets every step the resumed job runs, the replayed ones too. A tracker of the user's is
    handed what it said it needs to go on."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    setting = [{"mlflow": {"tracking_uri": uri, "experiment": "gone",
                           "artifact_location": str(tmp_path / "art")}},
               {"target": "tests.unit.test_trackers:Keeping"}]
    first, _ = _job_view(tmp_path, setting, None)
    first.start("job-g", 12)
    for s in range(6):
        first.step(_entry(s))
    first.close()
    c = MlflowClient(tracking_uri=uri)
    (old,) = c.search_runs([c.get_experiment_by_name("gone").experiment_id])
    c.delete_run(old.info.run_id)

    second, _ = _job_view(tmp_path, setting, "latest")
    second.start("job-g", 12)
    for s in range(3, 9):
        second.step(_entry(s))
    second.close()
    (new,) = c.search_runs([c.get_experiment_by_name("gone").experiment_id])
    assert new.info.run_id != old.info.run_id
    steps = sorted(m.step for m in c.get_metric_history(new.info.run_id, "loss"))
    assert steps == list(range(3, 9))
    assert KEPT == [(None, -1, [0, 1, 2, 3, 4, 5]), ({"token": "t-1"}, 5, [6, 7, 8])]


KEPT: list[Any] = []


class Keeping:
    """A user's tracker that keeps a token across a resume."""

    def start(self, run):
        KEPT.append((run.resumed, run.resumed_after, []))
        self.token = (run.resumed or {}).get("token", "t-1")

    def log_steps(self, entries):
        KEPT[-1][2].extend(e["step"] for e in entries)

    def log_events(self, events):
        pass

    def finish(self, status):
        pass

    def state(self):
        return {"token": self.token}


def test_a_resumed_tracker_that_keeps_no_state_is_sent_every_step_it_runs(tmp_path, monkeypatch):
    """A user's tracker with the four methods only opens a run of its own at each start: the
    replayed steps go to it too (they were skipped, and its new run lacked them)."""
    for resume in (None, "latest"):
        v, _ = _view(tmp_path, monkeypatch, name="stateless")
        v.cfg.resume = resume
        v.start("job-s", 10)
        for s in (range(6) if resume is None else range(3, 9)):
            v.step(_entry(s))
        v.close()
    assert [x[1] for x in SEEN["stateless"] if x[0] == "step"] == list(range(3, 9))


def test_a_resume_keeps_the_rows_of_trackers_that_did_not_start_and_skips_bad_rows(
        tmp_path, monkeypatch):
    """trackers.json after a resume still has the row of a tracker whose start failed (its
    next resume goes on with its run), and a row that is not one starts a run of its own
    instead of failing the job."""
    import json

    from elastic import trackers

    monkeypatch.setattr(trackers, "RETRY_S", (0.0, 0.0))
    run = tmp_path / "run"
    run.mkdir()
    rows = {"tests.unit.test_trackers:Recording#1": {"state": {"run": "r-7"}, "last_step": 5},
            "tests.unit.test_trackers:Keeping#1": {"state": None, "last_step": None}}
    (run / "trackers.json").write_text(json.dumps(rows))
    v, said = _job_view(tmp_path, [{"target": "tests.unit.test_trackers:Recording",
                                    "name": "down", "fail": "start", "times": -1},
                                   {"target": "tests.unit.test_trackers:Keeping"}], "latest")
    KEPT.clear()
    v.start("job-k", 10)
    for s in range(3, 6):
        v.step(_entry(s))
    v.close()
    assert KEPT == [(None, -1, [3, 4, 5])]  # the bad row: a run of its own, every step
    got = json.loads((run / "trackers.json").read_text())
    assert got["tests.unit.test_trackers:Recording#1"] == rows[
        "tests.unit.test_trackers:Recording#1"]
    assert got["tests.unit.test_trackers:Keeping#1"] == {"state": {"token": "t-1"},
                                                         "last_step": 5}
    assert any(k == "tracker_failed" for k, _ in said)


def test_a_resumed_tensorboard_that_ends_before_a_step_still_writes_its_file(tmp_path):
    """A resumed job that fails before its first step: TensorBoard's writer opens at the end
    (no purge: nothing replaces the earlier file's steps), with the events and the status."""
    first, _ = _job_view(tmp_path, ["tensorboard"], None)
    first.start("job-t", 10)
    for s in range(3):
        first.step(_entry(s))
    first.event(Event("finished", "3 steps", step=2))
    first.close()
    second, _ = _job_view(tmp_path, ["tensorboard"], "latest")
    second.start("job-t", 10)
    second.event(Event("failed", "no worker could be placed", step=3))
    second.close()
    recs = _tb_records(str(tmp_path / "run" / "tensorboard"))
    assert [s for s, tag, _ in recs if tag == "loss"] == [0, 1, 2]  # the first job's, kept
    assert "**failed**: no worker could be placed" in [x for _, tag, x in recs
                                                        if tag.startswith("events")]
    assert [x for _, tag, x in recs if tag == "status/text_summary"] == ["finished", "failed"]


def test_a_tracking_uri_with_a_password_is_said_without_it():
    """MLflow's tracking URI from the environment (``MLFLOW_TRACKING_URI``) may carry
    ``user:password@``: the ``tracker`` event that says where the run is shows it as the
    checkpoint URIs are shown (``shown_uri``: no user info). Was: the URI as given, into
    events.jsonl, the view and ``FitResult.events``. (The event's own text is not built here:
    that needs a tracking server behind an authenticated URI.)"""
    import inspect

    from elastic import trackers
    from elastic.checkpoint.location import shown_uri

    assert shown_uri("https://bob:HTTPPASS123@mlflow.example.com/x") == (
        "https://mlflow.example.com/x")
    assert shown_uri("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"
    assert "shown_uri(str(self._c.tracking_uri))" in inspect.getsource(trackers.MlflowTracker)


def test_a_custom_trackers_options_are_checked_against_its_class_before_ray():
    """``{target: elastic.trackers:TensorBoardTracker, log_dri: tb}``: refused before Ray,
    naming the option and the one it meant. Was: found when the job started the tracker,
    which was then turned off while the job went on."""
    from elastic.errors import ConfigError
    from elastic.trackers import check_trackers_here

    target = "elastic.trackers:TensorBoardTracker"
    with pytest.raises(ConfigError, match=r"trackers.log_dri: is not an argument.*log_dir"):
        check_trackers_here((("custom", {"target": target, "log_dri": "tb"}),))
    check_trackers_here((("custom", {"target": target, "log_dir": "tb"}),))


def test_a_step_completed_while_a_worker_was_lost_sends_no_speed(tmp_path):
    """A step whose metrics were lost with a worker is recorded (``StepLog.record``) with a
    ``note``, a NaN loss and no speed or step time (None), and goes to the trackers without
    them; its world size as it was. Was: 0 samples/s and a 0 s step, a drop to nothing on
    the charts that never happened."""
    import math

    from elastic import trackers
    from elastic.control.steps import StepLog
    from strategies import StrategySpec

    cfg = _cfg(tmp_path, ["tensorboard"])
    cfg.run_dir = str(tmp_path / "run")
    v = trackers.TrackerView(View(), cfg)
    v.bind(lambda *a, **kw: None)
    v.start("job-lost", 10)
    steps, spec = StepLog(None, v), StrategySpec("dp", 2, (4, 4))
    steps.record(0, _entry(0), spec, 1)
    steps.record(1, None, spec, 1)  # completed while a worker was lost
    steps.record(2, _entry(2), spec, 1)
    assert steps.history[1]["samples_per_s"] is None and "note" in steps.history[1]
    v.close()
    got = _tb_records(str(tmp_path / "run" / "tensorboard"))
    assert [s for s, tag, _ in got if tag == "samples_per_s"] == [0, 2]
    assert [s for s, tag, _ in got if tag == "step_time"] == [0, 2]
    assert [s for s, tag, _ in got if tag == "world_size"] == [0, 1, 2]
    assert math.isnan(next(x for s, tag, x in got if tag == "loss" and s == 1))


class FakeMlflow:
    """MlflowClient's calls the tracker makes, in memory; the first params batch fails."""

    runs: list[str] = []
    logged: list[tuple[str, str]] = []
    ended: list[tuple[str, str]] = []

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.tracking_uri = tracking_uri

    def get_experiment_by_name(self, name):
        return type("E", (), {"experiment_id": "0"})()

    def create_run(self, eid, run_name=None, tags=None):
        FakeMlflow.runs.append(f"run{len(FakeMlflow.runs)}")
        return type("R", (), {"info": type("I", (), {"run_id": FakeMlflow.runs[-1]})()})()

    def log_batch(self, run_id, params=(), metrics=()):
        if params and not any(what == "params failed" for what, _ in FakeMlflow.logged):
            FakeMlflow.logged.append(("params failed", run_id))
            raise ConnectionError("tracking server unreachable")
        FakeMlflow.logged.append(("params" if params else "metrics", run_id))

    def log_text(self, run_id, text, path):
        FakeMlflow.logged.append(("text", run_id))

    def set_terminated(self, run_id, status):
        FakeMlflow.ended.append((run_id, status))


def test_an_mlflow_start_tried_again_goes_on_with_the_run_it_made(tmp_path, monkeypatch):
    """Logging the settings fails once after the run was made: the start is tried again on
    that run. Was: a new run each try, the earlier ones left RUNNING for ever."""
    import mlflow.tracking

    from elastic import trackers

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FakeMlflow)
    FakeMlflow.runs, FakeMlflow.logged, FakeMlflow.ended = [], [], []
    monkeypatch.setattr(trackers, "RETRY_S", (0.0, 0.0))
    cfg = _cfg(tmp_path, [{"mlflow": {"tracking_uri": "http://tracking:5000"}}])
    v = trackers.TrackerView(View(), cfg)
    said: list[tuple[str, str]] = []
    v.bind(lambda kind, msg, **kw: said.append((kind, msg)))
    v.start("job-m", 10)
    v.step(_entry(0))
    v.event(Event("finished", "1 step"))
    v.close()
    assert FakeMlflow.runs == ["run0"], FakeMlflow.runs
    assert FakeMlflow.logged == [("params failed", "run0"), ("params", "run0"),
                                 ("metrics", "run0"), ("text", "run0")]
    assert FakeMlflow.ended == [("run0", "FINISHED")]
    assert [k for k, _ in said] == ["tracker_failed", "tracker"]


def test_mlflows_events_are_written_while_the_job_runs_not_only_at_its_end(monkeypatch):
    """A driver killed before its end (a preemption of its own) left the MLflow run without
    any of the job's events: the artifact was written at ``finish`` only (found by review).
    It is written again when events come, at most every ``EVENTS_EVERY_S``."""
    import mlflow.tracking

    from elastic import trackers

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FakeMlflow)
    FakeMlflow.runs, FakeMlflow.logged, FakeMlflow.ended = [], [], []
    t = trackers.MlflowTracker()
    t._c, t.run_id = FakeMlflow(), "run9"
    monkeypatch.setattr(trackers, "EVENTS_EVERY_S", 0.0)
    t.log_events([Event("recovered", "from peers", step=4)])
    assert FakeMlflow.logged == [("text", "run9")]
    monkeypatch.setattr(trackers, "EVENTS_EVERY_S", 3600.0)
    t.log_events([Event("scaled", "to 3", step=9)])  # within the minute: not again yet
    assert FakeMlflow.logged == [("text", "run9")]
