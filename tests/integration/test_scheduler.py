"""The live scheduler on a real multi-node Ray cluster: admission, shrink to make room, grow
when a job ends, cancel, and every job's final parameters equal to its solo run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import elastic
from elastic import scheduler
from elastic.errors import ElasticError
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mse, slow_mlp

BATCH = 12  # divides among 1..4 workers
# the restart test's job still running when the scheduler dies: ~0.12 s steps (~5 s in all),
# the kill comes ~0.3-1 s after its step 2 (it runs again from step 0 after the restart)
GOOD = 40


def _job(name: str, steps: int, tmp_path, **kw):
    return dict(model=slow_mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                global_batch_size=BATCH, max_steps=steps, view="none", name=name,
                run_dir=str(tmp_path / name), **kw)


def _wait(sched, cond, what: str, timeout: float = 180.0) -> dict:
    """Poll the queue until ``cond(rows by job)`` holds; fail naming ``what`` and the queue."""
    import ray

    t0 = time.time()
    while True:
        rows = {r["job"]: r for r in ray.get(sched.rows.remote())}
        if cond(rows):
            return rows
        if time.time() - t0 > timeout:
            info = ray.get(sched.info.remote())
            pytest.fail(f"timed out waiting for {what}: {rows} {info}")
        time.sleep(0.25)


def test_the_sdks_scheduler_start_refuses_bad_settings_before_ray():
    """No cluster, no actor: the SDK's start refuses workers=0 and round_s=-1 with the
    setting named (was: an actor's death and a stack dump; a core spinning)."""
    from elastic import scheduler
    from elastic.errors import ConfigError

    for kw, field in (({"workers": 0}, "workers"), ({"workers": 2, "round_s": -1}, "round_s")):
        with pytest.raises(ConfigError) as e:
            scheduler.start("never", **kw)  # type: ignore[arg-type]
        assert e.value.field == field


def test_admission_shrink_to_make_room_grow_when_a_job_ends(ray_cluster, tmp_path):
    import ray

    ray_cluster(4)  # 4 worker nodes of 1 CPU: the scheduler owns all 4
    # warm workers: the processes a shrink lets go serve the short job and the long one's
    # growth back (the cold path is the restart test's; test_pool.py checks the warm one)
    sched = scheduler.start("t", workers=4, policy="srpt", round_s=0.5, resize_s=0.0,
                            detached=False, warm=4)
    with pytest.raises(ElasticError, match="already running"):
        scheduler.start("t", workers=4)
    with pytest.raises(ElasticError, match="holds no job 'nope'"):  # (was: StopIteration)
        scheduler.ScheduledJob("t", "nope").status()
    try:
        long = elastic.submit(_job("long", 100_000, tmp_path, num_workers=2, min_workers=1,
                                   max_workers=4), scheduler="t")
        # admitted; alone, it takes every worker it uses well (its steps divide among them)
        rows = _wait(sched, lambda r: r["long"]["state"] == "running"
                     and r["long"]["workers"] == 4 and r["long"]["step"] >= 3, "long at 4")
        assert "#1 by remaining work" in rows["long"]["reason"]
        short = elastic.submit(_job("short", 30, tmp_path, num_workers=2, min_workers=1,
                                    max_workers=3), scheduler="t")
        # the short job goes first: the long one shrinks to make room, never stops
        rows = _wait(sched, lambda r: r["short"]["state"] in ("running", "finished"),
                     "short admitted")
        assert rows["long"]["workers"] == 1 and rows["long"]["state"] == "running", rows
        assert "shrunk 4->1" in rows["long"]["reason"], rows["long"]
        assert rows["short"]["workers"] in (3, 0), rows["short"]
        # the short one ends; the long one grows back
        rows = _wait(sched, lambda r: r["short"]["state"] == "finished"
                     and r["long"]["workers"] == 4 and not r["long"]["resizing"],
                     "long grown back after short")
        assert rows["long"]["resizes"] == 2, rows["long"]  # 4->1, 1->4, both answered
        out = short.result(timeout=60)
        assert out["state"] == "finished" and out["steps"] == 30
        ref, _ = reference_train(slow_mlp, adam, mse, RegressionData(), BATCH, 30, seed=0)
        assert max_diff(out["state_dict"], ref) < 1e-5
        # cancel the long job: it stops at a step boundary; its parameters are its solo run's
        assert long.cancel() == "running"
        out = long.result(timeout=120)
        assert out["state"] == "cancelled" and out["steps"] > 3
        ref, _ = reference_train(slow_mlp, adam, mse, RegressionData(), BATCH, out["steps"],
                                 seed=0)
        assert max_diff(out["state_dict"], ref) < 1e-5
        assert not ray.get(sched.info.remote())["errors"]
    finally:
        scheduler.shutdown("t")


def test_a_failing_job_leaves_the_others_alone_and_the_queue_survives_a_restart(
        ray_cluster, tmp_path):
    import ray

    from tests.helpers import failing_model

    ray_cluster(2)
    db = str(tmp_path / "queue.sqlite")
    # detached, as `elastic scheduler start` runs it: what its jobs reserve (placement groups)
    # lives and dies with it, not with this driver
    sched = scheduler.start("r", workers=2, policy="fifo-static", round_s=0.5, detached=True,
                            db=db)
    try:
        bad = elastic.submit(dict(_job("bad", 50, tmp_path, num_workers=1),
                                  model=failing_model), scheduler="r")
        good = elastic.submit(_job("good", GOOD, tmp_path, num_workers=1), scheduler="r")
        waits = elastic.submit(_job("waits", 30, tmp_path, num_workers=2), scheduler="r")
        out = bad.result(timeout=180)
        assert out["state"] == "failed" and out["error"], out
        assert out["steps"] == 0 and out["history"] == [], out  # (what it trained: none)
        _wait(sched, lambda r: r["good"]["state"] == "running" and r["good"]["step"] >= 2,
              "good running")
        # the scheduler goes away: its process ran the jobs' controllers
        ray.kill(sched)
        deadline = time.time() + 30
        while "r" in scheduler.list_schedulers():  # Ray frees a dead actor's name
            assert time.time() < deadline
            time.sleep(0.5)
        sched = scheduler.start("r", workers=2, policy="fifo-static", round_s=0.5,
                                detached=True, db=db)
        assert ray.get(sched.info.remote())["restored"] >= 1
        rows = {r["job"]: r for r in ray.get(sched.rows.remote())}
        assert rows["bad"]["state"] == "failed"
        assert rows["good"]["state"] in ("queued", "running")
        for job, steps in ((good, GOOD), (waits, 30)):
            out = job.result(timeout=240)
            assert out["state"] == "finished" and out["steps"] == steps, out
            ref, _ = reference_train(slow_mlp, adam, mse, RegressionData(), BATCH, steps, seed=0)
            assert max_diff(out["state_dict"], ref) < 1e-5
        # the CLI reads the same queue
        address = ray.get_runtime_context().gcs_address
        cli = [sys.executable, "-m", "elastic.cli", "queue"]
        procs = [subprocess.Popen(cli + args + ["--name", "r", "--address", address],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for args in (["list"], ["cancel", "nope"])]  # both at once: ~3 s each
        try:
            (out, err), (_, err2) = (p.communicate(timeout=120) for p in procs)
        finally:
            for p in procs:
                p.kill()  # a no-op for one that ended
        assert procs[0].returncode == 0, err
        lines = {ln.split()[0]: ln for ln in out.splitlines()[2:]}
        assert "finished" in lines["good"] and "failed" in lines["bad"], out
        assert procs[1].returncode == 2 and "no job named 'nope'" in err2, err2
    finally:
        scheduler.shutdown("r")
