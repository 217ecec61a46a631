"""Live strategy switches on Ray actors: the state moves in memory into the new layout, the
state hash is unchanged, and the run ends where single-process PyTorch ends.

Tolerance 1e-5 (as in test_fit.py): every layout computes the same mean gradient over the same
G samples; only float32 addition order differs between layouts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import elastic
from elastic.errors import ConfigError
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

G = 12
TOL = 1e-5


def _cfg(tmp_path, **kw):
    base = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
                num_workers=2, view="none", run_dir=str(tmp_path / "run"))
    base.update(kw)
    return base


def test_switch_schedule_dp_zero3_pipeline_zero1_dp(ray_local, tmp_path):
    steps = 15
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, steps, seed=0)
    result = elastic.fit(**_cfg(tmp_path, max_steps=steps,
                                switch_at={3: "zero3", 6: "pipeline", 9: "zero1", 12: "dp"}))
    assert max_diff(result.state_dict(), ref) < TOL
    switches = [e for e in result.events if e.kind == "switch"]
    assert [(e.data["from"], e.data["to"]) for e in switches] == [
        ("dp", "zero3"), ("zero3", "pipeline"), ("pipeline", "zero1"), ("zero1", "dp")]
    for e in switches:
        assert e.data["state_preserved"] and e.data["seconds"] > 0 and e.data["reason"]
        assert e.data["check"] == "pieces" and e.data["problems"] == []
    strategies = [h["strategy"] for h in result.history]
    assert strategies == ["dp"] * 3 + ["zero3"] * 3 + ["pipeline"] * 3 + ["zero1"] * 3 + ["dp"] * 3


def test_sdk_and_cli_switch_on_a_running_job_and_memory_is_real(ray_local, tmp_path):
    handle = elastic.submit(**_cfg(tmp_path, max_steps=100_000, name="switchy"))
    t0 = time.time()
    while handle.status()["step"] < 2:
        assert not handle.done() and time.time() - t0 < 60
        time.sleep(0.05)
    dp_mem = handle.controller_memory()
    assert handle.switch("zero2") == "zero2"
    z2 = handle.controller_memory()
    # zero2 shards gradients and optimizer state (each rank ~1/2 of dp's); params stay whole
    for r in range(2):
        assert z2[r]["params"] == dp_mem[r]["params"]
        assert z2[r]["optim"] < 0.75 * dp_mem[r]["optim"]
    assert sum(m["optim"] for m in z2) == dp_mem[0]["optim"]
    # a refused switch leaves the job running in its old layout
    with pytest.raises(elastic.SwitchError, match="turbo"):
        handle.switch("turbo")
    address = ray_local.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "switch", "switchy", "zero3",
                          "--address", address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    z3 = handle.controller_memory()
    assert all(m["params"] < 0.75 * dp_mem[0]["params"] for m in z3)
    assert handle.status()["strategy"] == "zero3"
    handle.stop()
    result = handle.result(timeout=60)
    kinds = [e.kind for e in result.events]
    assert kinds.count("switch") == 2 and "switch_refused" in kinds
    steps = len(result.history)
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, steps, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL


def test_a_scheduled_switch_that_cannot_run_is_refused_before_the_job_starts(tmp_path):
    """switch_at names a layout no world of this job can run (5 micro-batches do not divide a
    replica's samples): refused with the step named, before any worker or Ray starts. Was
    (until session 43): accepted, and refused at its step ("switch_failed ... goes on as
    dp"), which for a long job was hours in. A switch that fails at its step for what the
    start cannot know (the world changed) still leaves the job on its layout:
    tests/unit/test_controller.py (``switch_failed``)."""
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        elastic.fit(**_cfg(tmp_path, max_steps=8, micro_batches=5, switch_at={4: "pipeline"}))
    assert e.value.field == "switch_at[4]" and "micro-batches" in str(e.value), str(e.value)
    assert "drop this switch" in e.value.fix and time.monotonic() - t0 < 30


