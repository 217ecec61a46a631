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
