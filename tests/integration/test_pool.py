"""Warm workers (elastic.WorkerPool) on one local Ray: jobs in a row on the same worker
processes, fast, training what single-process PyTorch trains; a worker killed while idle is
never handed out; what a job can see of the previous one in the same process; a worker
whose job failed in user code, or that still runs the job's thread, is retired.

Tolerance: as tests/integration/test_fit.py (1e-5 after 12 Adam steps)."""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import time

import pytest

import elastic
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse
from tests.integration import _pool_user

pytestmark = pytest.mark.cold_workers  # these tests bring their own pools

STEPS, G, TOL = 12, 10, 1e-5


def _job(pool, tmp_path, tag: str, model=mlp, **kw):
    """Run a 2-worker job on ``pool``; returns (result, seconds from fit() to its first
    completed step, the workers' pids)."""
    t0 = time.perf_counter()
    first: list[float] = []

    def on_step(entry):
        if not first:
            first.append(time.perf_counter() - t0)

    cfg = dict(model=model, optimizer=adam, loss=mse, dataset=RegressionData(),
               global_batch_size=G, max_steps=STEPS, num_workers=2, view="none",
               run_dir=str(tmp_path / tag), on_step=on_step, pool=pool)
    cfg.update(kw)
    res = elastic.fit(**cfg)
    pids = sorted(int(w["pid"]) for w in _workers(res))
    return res, first[0], pids


def _workers(res) -> list[dict]:
    """The workers the job was placed on (its ``placed`` event)."""
    return next(e for e in res.events if e.kind == "placed").data["workers"]


@pytest.fixture
def pool(ray_local):
    p = elastic.WorkerPool(2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference():
    return reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)[0]


def test_jobs_in_a_row_reuse_the_same_processes_fast(pool, tmp_path, reference):
    idle = pool.info()["idle_pids"]
    assert len(idle) == 2 and pool.info()["started"] == 2
    a, first_a, pids_a = _job(pool, tmp_path, "a")
    b, first_b, pids_b = _job(pool, tmp_path, "b")
    assert pids_a == pids_b == idle  # the pool's processes, both times
    assert max_diff(a.state_dict(), reference) < TOL
    assert max_diff(b.state_dict(), reference) < TOL
    assert first_b < 2.0, f"first step {first_b:.2f}s after submit on warm workers"
    info = pool.info()
    assert info["handed_out"] == 4 and info["cold"] == 0 and info["kept"] == 4, info
    assert info["started"] == 2 and not info["retired"], info
    # a third job asks for more than the pool holds: 2 warm, 1 cold, and all 3 come back
    c, _, pids_c = _job(pool, tmp_path, "c", num_workers=3)
    assert set(idle) <= set(pids_c) and len(pids_c) == 3
    assert max_diff(c.state_dict(), reference) < TOL
    assert pool.info()["cold"] == 1 and sorted(pool.info()["idle_pids"]) == pids_c


def test_a_worker_killed_while_idle_is_not_handed_out(pool, tmp_path, reference):
    dead, alive = pool.info()["idle_pids"]
    os.kill(dead, signal.SIGKILL)
    res, _, pids = _job(pool, tmp_path, "after-kill")
    assert dead not in pids and alive in pids and len(pids) == 2
    assert max_diff(res.state_dict(), reference) < TOL
    info = pool.info()
    assert info["retired"] == {"died while idle": 1}, info
    assert info["cold"] == 1 and dead not in info["idle_pids"], info


def test_what_the_next_job_sees_of_the_previous_one(pool, tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    first = functools.partial(_pool_user.model, str(out), "first")
    second = functools.partial(_pool_user.model, str(out), "second")
    ref = reference_train(first, adam, mse, RegressionData(), G, STEPS, seed=0)[0]
    a, _, pids_a = _job(pool, tmp_path, "first", model=first)
    b, _, pids_b = _job(pool, tmp_path, "second", model=second)
    assert pids_a == pids_b
    for res in (a, b):  # the same parameters on recycled processes
        assert max_diff(res.state_dict(), ref) < TOL
    seen = {}
    for path in glob.glob(str(out / "second-*.json")):
        rec = json.load(open(path))
        seen.setdefault(rec["pid"], []).append(rec)
    assert sorted(seen) == pids_b
    for pid, recs in seen.items():
        # the job's module was imported afresh: its globals start over (the first job built
        # its model in this process too), and at import it saw no environment variable the
        # first job set, no process group, no tensor of the first job's model or optimizer
        assert min(r["builds"] for r in recs) == 1, recs
        imp = recs[0]["import"]
        assert imp == {"env": None, "group": False, "marked_tensors": 0}, (pid, imp)
    assert glob.glob(str(out / "first-*.json"))  # the first job did record (and set) them


def test_user_error_or_leaked_thread_retires_the_worker(pool, tmp_path, reference):
    from elastic.errors import WorkerError

    before = pool.info()["idle_pids"]
    with pytest.raises(WorkerError):
        _job(pool, tmp_path, "raises", faults=[{"rank": 0, "step": 3, "action": "raise"}])
    info = pool.info()
    retired = {k: v for k, v in info["retired"].items() if "user code" in k}
    assert sum(retired.values()) == 1, info  # rank 0's process; rank 1's was reset and kept
    assert len(info["idle_pids"]) == 1 and info["idle_pids"][0] in before, info
    out = tmp_path / "leak"
    out.mkdir()
    leaky = functools.partial(_pool_user.model, str(out), "leak", leak_thread=True)
    _, _, leak_pids = _job(pool, tmp_path, "leaks", model=leaky)
    info = pool.info()
    assert sum(v for k, v in info["retired"].items() if "thread" in k) == 2, info
    assert not set(info["idle_pids"]) & set(leak_pids), info  # new ones start in their place
    res, _, pids = _job(pool, tmp_path, "after", model=mlp)  # cold again, still right
    assert max_diff(res.state_dict(), reference) < TOL
    assert not set(pids) & set(before)


def test_a_job_right_after_one_that_failed_on_every_rank_takes_the_refills(pool, tmp_path,
                                                                           reference):
    """The pool holds the only room (the cluster's other CPUs are taken), and a job fails in
    user code on both ranks: both workers are retired and two refills start in their place.
    The next job, started at once, waits for them and takes them. Was: it found none idle,
    its cold workers waited for CPUs the refills held, and it failed after its placement
    timeout ("the cluster cannot host 2 workers", found by a new user's retry, session 46)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from elastic.errors import WorkerError

    others = placement_group([{"CPU": 1}, {"CPU": 1}])  # another tenant's two CPUs
    ray.get(others.ready(), timeout=30)
    try:
        with pytest.raises(WorkerError):
            _job(pool, tmp_path, "raises", faults=[{"rank": r, "step": 1, "action": "raise"}
                                                   for r in (0, 1)])
        assert pool.info()["starting"] == 2, pool.info()  # the refills, up in a few seconds
        t0 = time.monotonic()
        res, _, pids = _job(pool, tmp_path, "next", placement_timeout_s=20)
        assert time.monotonic() - t0 < 20
        assert max_diff(res.state_dict(), reference) < TOL
        info = pool.info()
        assert info["cold"] == 0 and info["handed_out"] == 4, info  # 2 to each job, warm
        assert pids == sorted(info["idle_pids"]), info  # the refills, back in the pool
    finally:
        remove_placement_group(others)


def test_code_that_does_not_import_on_warm_workers_fails_at_once_with_why(pool, tmp_path,
                                                                         reference):
    """The pool's workers cannot import the job's model: the job fails with that reason
    within seconds, and the pool's bundles are not left held (before: the failed warm
    workers' bundles stayed reserved, the cold ones could not be placed, and the job waited
    its 60 s placement timeout to say the cluster was too small). The pool made the
    process's default serves ``fit`` without ``pool=``."""
    from elastic.errors import ClusterError

    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="failed to start.*cannot be imported on the workers"):
        _job(pool, tmp_path, "no-import", model="tests._fails_in_actors:mlp")
    assert time.monotonic() - t0 < 30
    import ray

    pool.wait_ready()  # it starts two new workers in place of the two that failed
    info = pool.info()
    assert info["idle"] == 2 and info["lent"] == 0 and info["starting"] == 0, info
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2  # only the pool's idle two are held
    pool.make_default()
    try:
        res = elastic.fit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                          global_batch_size=G, max_steps=STEPS, num_workers=2, view="none",
                          run_dir=str(tmp_path / "default"))
        assert max_diff(res.state_dict(), reference) < TOL
        assert pool.info()["idle"] == 2 and pool.info()["kept"] == 2, pool.info()
    finally:
        pool.close()
    from elastic.control.pool import default_pool

    assert default_pool() is None  # closed: no longer the default


def test_scheduler_jobs_run_on_its_warm_workers(ray_local, tmp_path, reference):
    from elastic import scheduler

    sched = scheduler.start("warm-t", workers=2, policy="fifo-static", round_s=0.2,
                            detached=False, warm=2)
    try:
        pool = scheduler.info("warm-t")["pool"]
        assert pool["idle"] == 2, pool
        placed = []
        for tag in ("s1", "s2"):  # one after the other, as a sweep's trials
            job = elastic.submit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                                 global_batch_size=G, max_steps=STEPS, num_workers=2,
                                 view="none", name=tag, run_dir=str(tmp_path / tag),
                                 scheduler="warm-t")
            out = job.result(timeout=120)
            assert out["state"] == "finished", out
            assert max_diff(out["state_dict"], reference) < TOL
            with open(os.path.join(out["run_dir"], "events.jsonl")) as f:
                ev = next(e for e in map(json.loads, f) if e["kind"] == "placed")
            placed.append(ev["data"])
        assert [p["warm"] for p in placed] == [2, 2], placed
        pids = [sorted(w["pid"] for w in p["workers"]) for p in placed]
        assert pids[0] == pids[1] == sorted(pool["idle_pids"]), (pids, pool)
        assert scheduler.info("warm-t")["pool"]["kept"] == 4
    finally:
        import ray

        ray.get(sched.shutdown.remote())
        ray.kill(sched)


def test_a_job_of_another_pool_gets_the_room_idle_workers_hold(ray_local, tmp_path, reference):
    """One pool's idle workers hold every CPU; a job of another pool of the same process must
    start its 2 workers cold: the first pool retires 2 idle workers for it (before, the job
    waited out its placement timeout and failed while 4 idle processes held the CPUs). Then
    a job of 2-CPU workers lacks 4 CPUs: its own pool's 2 idle 1-CPU workers go, and the other
    pool's last 2 (room is counted in CPUs: counted in workers, the first 2 covered the
    2 missing bundles, 2 CPUs stayed held, and the job failed at its placement timeout)."""
    from clusters.pool_policy import ROOM

    full = elastic.WorkerPool(4, max_idle=4)
    mine = elastic.WorkerPool(0)
    try:
        assert full.info()["idle"] == 4  # ray_local's 4 CPUs
        res, _, _ = _job(mine, tmp_path, "room", placement_timeout_s=20)
        assert max_diff(res.state_dict(), reference) < TOL
        info = full.info()
        assert info["retired"] == {ROOM: 2} and info["idle"] == 2, info
        assert mine.info()["idle"] == 2 and mine.info()["cold"] == 2, mine.info()
        res, _, _ = _job(mine, tmp_path, "room2", placement_timeout_s=20,
                         resources_per_worker={"CPU": 2})
        assert max_diff(res.state_dict(), reference) < TOL
        info = full.info()
        assert info["retired"] == {ROOM: 4} and info["idle"] == 0, info
        assert mine.info()["cold"] == 4, mine.info()
    finally:
        mine.close()
        full.close()

