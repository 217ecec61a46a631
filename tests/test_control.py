"""Live control: the SDK handle and the named control actor reach a running job."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import elastic
from elastic import control
from elastic.errors import JobNotFoundError
from tests.helpers import RegressionData, adam, mlp, mse


def _wait_running(handle, timeout=60):
    t0 = time.time()
    while handle.status().get("step", 0) < 2:
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


def test_scale_through_cli_and_sdk_keeps_the_trajectory(ray_local, tmp_path):
    from elastic.reference import reference_train
    from tests.helpers import max_diff

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
    handle.stop()
    result = handle.result(timeout=60)
    scaled = [(e.data["from"], e.data["to"], e.data["source"]) for e in result.events
              if e.kind == "scaled"]
    assert scaled == [(2, 3, "peers"), (3, 1, "peers")], [
        (e.kind, e.message) for e in result.events]
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), 12, len(result.history), seed=0)
    assert max_diff(result.state_dict(), ref) < 1e-5
