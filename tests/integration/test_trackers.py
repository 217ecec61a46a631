"""A real job's trackers: TensorBoard's event files and an MLflow run (a SQLite tracking
store) hold every completed step's numbers once, the events and the settings, across a live
strategy switch and a resumed job, and say how the job ended."""

from __future__ import annotations

import os

import elastic
from tests.helpers import RegressionData, adam, mlp, mse
from tests.unit.test_trackers import _tb_records

STEPS, G = 12, 10


def test_a_jobs_steps_events_and_settings_reach_tensorboard_and_mlflow(ray_local, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = {"tensorboard": {}, "mlflow": {"tracking_uri": uri, "experiment": "exp",
                                              "tags": {"team": "t"},
                                              "artifact_location": str(tmp_path / "art")}}
    ckpt = str(tmp_path / "ckpt")
    res = elastic.fit(
        model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=STEPS, num_workers=2, view="none", run_dir=str(tmp_path / "run"),
        name="tracked", switch_at={6: "zero2"}, checkpoint_uri=ckpt, checkpoint_every=5,
        trackers=trackers)
    losses = [h["loss"] for h in res.history]
    where = [e.message for e in res.events if e.kind == "tracker"]
    assert len(where) == 2 and not [e for e in res.events if e.kind == "tracker_failed"]

    recs = _tb_records(os.path.join(res.run_dir, "tensorboard"))
    tb = [(s, x) for s, tag, x in recs if tag == "loss"]
    assert [s for s, _ in tb] == list(range(STEPS))
    assert all(abs(x - y) < 1e-6 * max(1.0, abs(y)) for (_, x), y in zip(tb, losses, strict=True))
    assert any("**switch**: dp -> zero2" in x for _, tag, x in recs if tag.startswith("events"))

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("exp")
    (run,) = c.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.info.run_id in where[1] or run.info.run_id in where[0]
    assert run.data.tags["team"] == "t" and run.data.tags["elastic.job"] == "tracked"
    assert run.data.params["global_batch_size"] == str(G)
    hist = sorted(c.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(STEPS))
    assert all(abs(m.value - y) < 1e-6 * max(1.0, abs(y)) for m, y in zip(hist, losses, strict=True))
    ws = c.get_metric_history(run.info.run_id, "world_size")
    assert {m.value for m in ws} == {2.0}
    events = c.download_artifacts(run.info.run_id, "elastic/events.txt", str(tmp_path / "dl"))
    with open(events) as f:
        text = f.read()
    assert ": switch: dp -> zero2" in text and ": finished: " in text

    # resumed in the same run dir from step 5: steps 5-11 run again, 12-15 are new
    more = elastic.fit(
        model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=STEPS + 4, num_workers=2, view="none", run_dir=str(tmp_path / "run"),
        name="tracked", resume=f"{ckpt}/step-{5:012d}", trackers=trackers)
    assert [h["step"] for h in more.history] == list(range(5, STEPS + 4))
    (again,) = c.search_runs([exp.experiment_id])  # the same run, on
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    hist = sorted(c.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(STEPS + 4))
    recs = _tb_records(os.path.join(res.run_dir, "tensorboard"))
    assert sorted(s for s, tag, _ in recs if tag == "loss") == list(range(STEPS + 4))
