"""Live control: the SDK handle and the named control actor reach a running job."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import elastic
from elastic import control
from elastic.errors import ElasticError, JobNotFoundError, SwitchError
from tests.helpers import RegressionData, adam, mlp, mse


def _wait_running(handle, timeout=60):
    """Until the job has trained 2 steps and its control actor says it runs (on warm
    workers a job trains its first steps before that actor's own process is up)."""
    import ray

    t0 = time.time()
    name = handle.controller.cfg.job_name
    while (handle.status().get("step", 0) < 2
           or ray.get(control.lookup(name).get_status.remote())["state"] != "running"):
        assert not handle.done(), handle.result()
        assert time.time() - t0 < timeout
        time.sleep(0.1)


def test_status_and_stop_through_named_actor_and_cli(ray_local, tmp_path):
    handle = elastic.submit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                            global_batch_size=8, max_steps=100_000, num_workers=2, view="none",
                            name="ctl-test", run_dir=str(tmp_path))
    _wait_running(handle)
    assert "ctl-test" in control.list_jobs()
    address = ray_local.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "status", "ctl-test",
                          "--address", address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"state": "running"' in out.stdout
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "status", "no-such-job",
                          "--address", address], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no running elastic job named 'no-such-job'" in out.stderr
    reply = control.ask("ctl-test", "stop")
    assert reply["ok"] and reply["result"] == "stopped"
    result = handle.result(timeout=60)
    assert 2 <= len(result.history) < 100_000
    assert any(e.kind == "stopped" for e in result.events)
    with pytest.raises(JobNotFoundError):
        control.lookup("ctl-test")


def _stop_after_2_3_1(handle, model):
    """Stop a job (global batch 12) that was resized 2 -> 3 -> 1: both resizes took the
    state from peers, and its parameters match one process over the steps it ran; returns
    them."""
    from elastic.reference import reference_train
    from tests.helpers import max_diff

    handle.stop()
    result = handle.result(timeout=60)
    scaled = [(e.data["from"], e.data["to"], e.data["source"]) for e in result.events
              if e.kind == "scaled"]
    assert scaled == [(2, 3, "peers"), (3, 1, "peers")], [
        (e.kind, e.message) for e in result.events]
    ref, _ = reference_train(model, adam, mse, RegressionData(), 12, len(result.history),
                             seed=0)
    state = result.state_dict()
    assert max_diff(state, ref) < 1e-5
    return state


def test_scale_through_cli_and_sdk_keeps_the_trajectory(ray_local, tmp_path):
    handle = elastic.submit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                            global_batch_size=12, max_steps=100_000, num_workers=2,
                            min_workers=1, max_workers=3, view="none", name="scaly",
                            run_dir=str(tmp_path), scale_check_s=3600)
    _wait_running(handle)
    address = ray_local.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "scale", "scaly", "3",
                          "--address", address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert handle.status()["world_size"] == 3, (out.stdout, [e.message for e in
                                                             handle.controller.events])
    assert handle.scale(1) == 1
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "scale", "scaly", "7",
                          "--address", address], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "outside min_workers..max_workers" in out.stderr
    _stop_after_2_3_1(handle, mlp)


def test_a_tied_weight_stays_tied_through_live_resizes(ray_local, tmp_path):
    """A model sharing one weight between two layers, under zero3 (the shared tensor is
    sharded once), grown 2 -> 3 and shrunk 3 -> 1 while it trains: each resize moves the
    state between ranks from their peers (not a switch's in-place re-layout nor a
    checkpoint's load, which test_fit's tied-weight test covers), and the result matches one
    process with the two layers still one tensor."""
    import torch

    from tests.helpers import TiedMlp

    handle = elastic.submit(model=TiedMlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                            global_batch_size=12, max_steps=100_000, num_workers=2,
                            min_workers=1, max_workers=3, strategy="zero3", view="none",
                            name="tied-scale", run_dir=str(tmp_path), scale_check_s=3600)
    _wait_running(handle)
    assert handle.scale(3) == 3
    assert handle.scale(1) == 1
    state = _stop_after_2_3_1(handle, TiedMlp)
    assert torch.equal(state["again.weight"], state["mid.weight"])


def test_malformed_and_unmeetable_requests_do_not_touch_the_job(ray_local, tmp_path):
    """Through the mailbox: 'abc', None and 2.9 workers are refused by the mailbox itself
    and the job goes on; a growth no room can meet is refused after a bounded wait while
    training goes on (no pause for the placement timeout)."""
    from elastic.control import sizing

    handle = elastic.submit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                            global_batch_size=12, max_steps=100_000, num_workers=2,
                            min_workers=1, max_workers=12, view="none", name="reqs",
                            run_dir=str(tmp_path), resources_per_worker={"CPU": 1})
    _wait_running(handle)
    for bad in ("abc", None, 2.9, True, -1):
        with pytest.raises(ElasticError, match="scale needs"):
            control.ask("reqs", "scale", bad, timeout_s=30)
    with pytest.raises(ElasticError, match="unknown request"):
        control.ask("reqs", "explode", timeout_s=30)
    assert handle.status()["state"] == "running" and not handle.done()
    sizing.SCALE_WAIT_S = 3.0  # this process runs the controller: a short bounded wait
    try:
        before = handle.status()["step"]
        t0 = time.time()
        with pytest.raises(SwitchError, match="cannot scale to 12 workers"):
            handle.scale(12, timeout=120)
        assert time.time() - t0 < 30
        assert handle.status()["step"] > before and handle.status()["world_size"] <= 4
    finally:
        sizing.SCALE_WAIT_S = 30.0
    handle.stop()
    handle.result(timeout=60)


def test_a_refused_job_does_not_touch_the_running_one(ray_local, tmp_path):
    """A second job with a running job's name is refused before it writes anything: the
    running job's config.json and events.jsonl are untouched."""
    run_dir = tmp_path / "first"
    handle = elastic.submit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                            global_batch_size=8, max_steps=100_000, num_workers=1,
                            view="none", name="twin", run_dir=str(run_dir))
    _wait_running(handle)
    config_before = (run_dir / "config.json").read_text()
    events_before = (run_dir / "events.jsonl").read_text().splitlines()
    with pytest.raises(ElasticError, match="already running") as info:
        elastic.fit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=3, num_workers=1, view="none",
                    name="twin", run_dir=str(tmp_path / "second"))
    assert "{job}" not in str(info.value) and "elastic stop twin" in str(info.value)
    assert (run_dir / "config.json").read_text() == config_before
    assert (run_dir / "events.jsonl").read_text().splitlines()[:len(events_before)] == \
        events_before
    assert not any('"kind": "failed"' in line
                   for line in (run_dir / "events.jsonl").read_text().splitlines())
    handle.stop()
    handle.result(timeout=60)


def test_a_finished_jobs_name_runs_again_in_a_new_directory(ray_local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
              global_batch_size=8, max_steps=2, num_workers=1, view="none", name="again")
    r1 = elastic.fit(**kw)
    r2 = elastic.fit(**kw)
    assert r1.run_dir != r2.run_dir and r2.run_dir.endswith("again.2")
    assert len((tmp_path / "runs" / "again" / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(elastic.ConfigError, match="run_dir.*holds an earlier run"):
        elastic.fit(**kw, run_dir=r1.run_dir)
