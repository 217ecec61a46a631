"""Real node loss on a multi-node Ray cluster (ray.cluster_utils): survivors keep their
processes and memory, state comes back from surviving replicas or the last checkpoint, and the
run ends with the parameters of an uninterrupted run. Marked ``chaos``; CI runs them."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

import elastic
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, bn_mlp, max_diff, mlp, mse

pytestmark = pytest.mark.chaos

G = 12
STEPS = 40
TOL = 1e-5


def _slow_mse(out, y):
    time.sleep(0.05)  # long enough steps to hit them mid-run
    return mse(out, y)


def _submit(tmp_path, **kw):
    """The plain loss by default: a test that stops a rank with a fault (``pause``, ``exit``)
    holds its step however long the step is, and a slow loss only lengthens the steps after
    it (2 s a test; 10 s for a pipeline, which calls the loss once per micro-batch). A test
    that acts between steps (``_wait_step``, a drain) passes ``loss=_slow_mse``."""
    cfg = dict(
        model=mlp,
        optimizer=adam,
        loss=mse,
        dataset=RegressionData(),
        global_batch_size=G,
        max_steps=STEPS,
        num_workers=3,
        min_workers=1,
        max_workers=3,
        view="none",
        run_dir=str(tmp_path / "run"),
        hang_timeout_s=30,
        replacement_timeout_s=2,
    )
    cfg.update(kw)
    return elastic.submit(**cfg)


def _wait_step(handle, step, timeout=120):
    t0 = time.time()
    while handle.status()["step"] < step:
        assert not handle.done(), handle.result()
        assert time.time() - t0 < timeout, handle.status()
        time.sleep(0.05)


def _check_data_log(run_dir, history, steps=STEPS):
    """Every sample of every completed step was trained exactly once: each step is recorded
    once, by the generation whose metrics were kept, with disjoint ranges covering 0..G-1;
    where the ranks could report it, the all-reduced count of samples in its gradient is G.
    (A step whose gradient was applied just as a node died is recorded from the plan.)"""
    data = [json.loads(x) for x in open(os.path.join(run_dir, "data_log.jsonl"))]
    assert [h["step"] for h in history] == list(range(steps))
    for h in history:
        rows = [d for d in data if d["step"] == h["step"] and d["generation"] == h["generation"]]
        assert len(rows) == 1, rows
        covered = sorted(i for lo, hi in rows[0]["ranges"] for i in range(lo, hi))
        assert covered == list(range(G)), rows
        assert rows[0]["global_samples"] in (G, None)


@pytest.fixture(scope="module")
def reference():
    return reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)


def _lose_at(tmp_path, rank, step, action="pause"):
    """A fault entry pausing ``rank`` at ``step`` (or, ``pause_upload``, in its upload of
    checkpoint ``step``), and the file its report lands in."""
    faults = str(tmp_path / "faults")
    return ({"rank": rank, "step": step, "action": action, "dir": faults},
            os.path.join(faults, f"paused-rank{rank}-step{step}.json"))


def _wait_paused(handle, path, timeout=120):
    """The ``pause`` fault's report (``elastic/worker/faults.py``): the rank is blocked at the
    start of its step, and the file says on which node."""
    t0 = time.time()
    while not os.path.exists(path):
        assert not handle.done(), handle.result()
        assert time.time() - t0 < timeout, handle.status()
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def test_worker_node_lost_survivors_continue_from_peers(ray_cluster, tmp_path, reference):
    """Rank 1 pauses at the start of step 8 (a fault, not a timed guess), and its node goes."""
    cluster = ray_cluster(3)
    faults = str(tmp_path / "faults")
    handle = _submit(tmp_path, faults=[{"rank": 1, "step": 8, "action": "pause", "dir": faults}])
    paused = _wait_paused(handle, os.path.join(faults, "paused-rank1-step8.json"))
    ctl = handle.controller
    assert paused["rank"] == 1 and paused["step"] == 8 and paused["generation"] == 1
    assert paused["node_id"] == ctl.workers[1].info["node_id"]
    pids = {w.info["pid"] for w in ctl.workers if w.rank != 1}
    cluster.remove(paused["node_id"])
    result = handle.result(timeout=180)
    assert max_diff(result.state_dict(), reference[0]) < TOL
    rec = [e for e in result.events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["source"] == "peers"
    assert rec[0].data["steps_lost"] == 0 and rec[0].data["world_size"] == 2
    # the survivors are the same processes, nobody was restarted
    assert set(rec[0].data["pids"]) == pids
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert result.history[-1]["world_size"] == 2
    _check_data_log(result.run_dir, result.history)


def test_an_auto_job_loses_a_node_and_plans_again_for_the_survivors(ray_cluster, tmp_path,
                                                                   reference):
    """``strategy: auto`` on 3 workers; rank 1 pauses at step 8 and its node goes. The
    survivors are profiled and planned for again (a second ``plan`` event, on 2 workers), the
    job ends with the uninterrupted run's parameters. Was: the recovery asked the traits
    table about "auto" and the job failed with StrategyError."""
    cluster = ray_cluster(3)
    fault, path = _lose_at(tmp_path, 1, 8)
    handle = _submit(tmp_path, strategy="auto", replan_every=10, faults=[fault])
    paused = _wait_paused(handle, path)
    cluster.remove(paused["node_id"])
    result = handle.result(timeout=180)
    assert max_diff(result.state_dict(), reference[0]) < TOL
    plans = [e for e in result.events if e.kind == "plan"]
    assert len(plans) == 2 and " on 2 x " in plans[1].message, [e.message for e in plans]
    rec = [e for e in result.events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["world_size"] == 2
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert result.history[-1]["world_size"] == 2


@pytest.mark.warm_workers
def test_worker_process_exits_and_the_job_recovers(ray_cluster, tmp_path, reference):
    """Rank 2's process dies at the start of step 5 (``exit``); its node lives. The fault
    fires once: the recovered job replays no step into it again."""
    ray_cluster(3)
    handle = _submit(tmp_path, faults=[{"rank": 2, "step": 5, "action": "exit"}])
    result = handle.result(timeout=180)
    assert os.path.exists(os.path.join(result.run_dir, "faults", "fired-rank2-step5"))
    rec = [e for e in result.events if e.kind == "recovered"]
    assert len(rec) == 1, [(e.kind, e.message[:120]) for e in result.events]
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)


@pytest.mark.warm_workers
def test_a_worker_lost_as_the_final_state_is_gathered_leaves_the_job_finished(
        ray_cluster, tmp_path, reference):
    """Rank 2's process dies as zero3's final state is gathered after the last step; its
    peers' all-gathers fail inside torch's op dispatch. The group's failure: a recovery, then
    the state of the uninterrupted run. Was: 'user code failed' and no result for a job
    whose every step ran (found by a new user, session 48)."""
    ray_cluster(3)
    handle = _submit(tmp_path, strategy="zero3",
                     faults=[{"rank": 2, "step": STEPS, "action": "exit_final"}])
    result = handle.result(timeout=180)
    assert os.path.exists(os.path.join(result.run_dir, "faults", f"fired-rank2-step{STEPS}"))
    assert [e.kind for e in result.events if e.kind in ("failure", "recovered")] == [
        "failure", "recovered"], [(e.kind, e.message[:120]) for e in result.events]
    assert max_diff(result.state_dict(), reference[0]) < TOL


def test_rank0_node_lost_then_replacement_node_taken_in(ray_cluster, tmp_path, reference):
    """Rank 0 (the group's store) pauses at step 8 and its node goes, unannounced (the worker
    does not say its node went, as on a machine that vanishes: the controller finds it gone
    before Ray holds the node dead, and its bundle is still reserved on the dead node); a new
    node joins. The wait for a replacement counts from the loss and covers the new node's
    start and its worker's (torch import): ~10 s here, over 20 s on a loaded host, so it is
    generous (the recovery goes on as soon as the worker is up, not at the timeout)."""
    cluster = ray_cluster(3)
    fault, report = _lose_at(tmp_path, 0, 8, action="pause_silent")
    handle = _submit(tmp_path, replacement_timeout_s=90, faults=[fault])
    cluster.remove(_wait_paused(handle, report)["node_id"])
    cluster.add_node()
    result = handle.result(timeout=180)
    assert max_diff(result.state_dict(), reference[0]) < TOL
    rec = [e for e in result.events if e.kind == "recovered"]
    assert rec and rec[0].data["source"] == "peers" and rec[0].data["world_size"] == 3, [
        f"{e.time:.2f} {e.kind}: {e.message}" for e in result.events]
    _check_data_log(result.run_dir, result.history)


def test_below_min_workers_fails_clearly(ray_cluster, tmp_path):
    cluster = ray_cluster(2)
    fault, report = _lose_at(tmp_path, 1, 5)
    handle = _submit(tmp_path, num_workers=2, min_workers=2, max_workers=2,
                     min_workers_timeout_s=2, faults=[fault])
    cluster.remove(_wait_paused(handle, report)["node_id"])
    with pytest.raises(elastic.InfrastructureError, match="fewer than min_workers=2"):
        handle.result(timeout=120)


def test_scale_up_when_a_node_joins(ray_cluster, tmp_path):
    cluster = ray_cluster(2)
    steps = 400  # long enough that the new node surely joins mid-run; stopped once it has
    handle = _submit(tmp_path, loss=_slow_mse, num_workers=2, min_workers=1, max_workers=3,
                     scale_check_s=0.5,
                     max_steps=steps)
    _wait_step(handle, 5)
    cluster.add_node()
    t0 = time.time()
    # scaled, and a step trained at the new size (a stop sent right at the "scaled" event can
    # land at the boundary before the grown group's first step)
    while not (any(e.kind == "scaled" for e in handle.controller.events)
               and handle.controller.steps.last().get("world_size") == 3):
        assert not handle.done() and time.time() - t0 < 120, handle.controller.events
        time.sleep(0.05)
    handle.stop()
    result = handle.result(timeout=180)
    scaled = [e for e in result.events if e.kind == "scaled"]
    assert scaled[0].data["to"] == 3 and scaled[0].data["source"] == "peers"
    assert result.history[-1]["world_size"] == 3
    n = len(result.history)
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, n, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL
    _check_data_log(result.run_dir, result.history, n)


@pytest.mark.warm_workers
def test_zero3_loss_restores_from_checkpoint_and_replays(ray_cluster, tmp_path, reference):
    """No rank holds a whole tensor under zero3: a loss falls back to the last committed
    checkpoint; the steps since are trained again and the result is unchanged."""
    cluster = ray_cluster(3)
    fault, report = _lose_at(tmp_path, 2, 12)  # checkpoints after steps 5 and 10
    handle = _submit(tmp_path, strategy="zero3", checkpoint_every=5,
                     checkpoint_uri=str(tmp_path / "ckpt"), faults=[fault])
    cluster.remove(_wait_paused(handle, report)["node_id"])
    result = handle.result(timeout=180)
    rec = [e for e in result.events if e.kind == "recovered"]
    # restored checkpoint 10 (5 if 10 was still uploading); the steps since, up to the last
    # one every rank confirmed (11, or 10: step 11's agreement rides on step 12), run again
    assert rec and rec[0].data["source"] == "checkpoint"
    restored = int(re.search(r" at step (\d+) ", rec[0].message).group(1))
    assert restored in (10, 5) and 0 <= rec[0].data["steps_lost"] <= 12 - restored, rec[0]
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)


@pytest.mark.warm_workers
def test_pipeline_x_dp_loss_restores_from_surviving_stage_replicas(ray_cluster, tmp_path,
                                                                   reference):
    """pp2 x dp2: every stage keeps a live replica after one worker is lost."""
    cluster = ray_cluster(4)
    fault, report = _lose_at(tmp_path, 3, 6)
    handle = _submit(tmp_path, num_workers=4, min_workers=3, max_workers=4,
                     strategy="pipeline", pp_degree=2, faults=[fault])
    cluster.remove(_wait_paused(handle, report)["node_id"])
    result = handle.result(timeout=180)
    rec = [e for e in result.events if e.kind == "recovered"]
    assert rec and rec[0].data["source"] == "peers" and rec[0].data["steps_lost"] == 0
    # a survivor blocked on another survivor's sub-group (stage 0's dp all-reduce) fails as
    # soon as that one leaves: nobody waits out the group timeout (hang_timeout_s=30)
    assert not [e for e in result.events if e.kind == "hang"]
    t0 = result.events[0].time
    assert rec[0].data["seconds"] < 20, [(round(e.time - t0, 2), e.kind, e.message[:160])
                                         for e in result.events]
    assert max_diff(result.state_dict(), reference[0]) < TOL


@pytest.mark.warm_workers
def test_two_losses_in_a_row_and_one_during_a_checkpoint_upload(ray_cluster, tmp_path,
                                                                 reference):
    """Rank 1's node goes at step 6; then, in the second generation, rank 2's node goes while
    its shard of checkpoint 12 is uploading (``pause_upload``: the upload has begun and
    training goes on)."""
    cluster = ray_cluster(4)
    first, report1 = _lose_at(tmp_path, 1, 6)
    second, report2 = _lose_at(tmp_path, 2, 12, action="pause_upload")
    handle = _submit(tmp_path, loss=_slow_mse, num_workers=4, min_workers=1, max_workers=4,
                     checkpoint_every=3,
                     checkpoint_uri=str(tmp_path / "ckpt"), faults=[first, second])
    cluster.remove(_wait_paused(handle, report1)["node_id"])
    paused = _wait_paused(handle, report2)
    assert paused["generation"] == 2, paused
    cluster.remove(paused["node_id"])
    result = handle.result(timeout=180)
    rec = [e for e in result.events if e.kind == "recovered"]
    assert len(rec) == 2 and all(e.data["source"] == "peers" for e in rec)
    assert result.history[-1]["world_size"] == 2
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)


def test_a_node_lost_while_a_checkpoint_waits_for_an_upload_is_seen_at_once(
        ray_cluster, tmp_path, reference):
    """Rank 0's upload of checkpoint 5 takes 60 s (``slow_upload``), so at checkpoint 10
    every rank waits for it to commit (``checkpoint_wait_s`` 60). Rank 2's node goes during
    that wait. The controller asks every rank to give the wait up (the urgent stop a
    preemption notice uses), so the survivors recover at once and the run ends on the
    reference. Was: rank 0 waited out its upload (~55 s after the loss), its peers with it
    (found by a new user, session 48)."""
    cluster = ray_cluster(3)
    handle = _submit(tmp_path, loss=_slow_mse, checkpoint_every=5, checkpoint_wait_s=60,
                     checkpoint_uri=str(tmp_path / "ckpt"),
                     faults=[{"rank": 0, "step": 5, "action": "slow_upload", "seconds": 60}])
    _wait_step(handle, 8)
    t0, last = time.time(), handle.status()["step"]
    while time.time() - t0 < 2:  # the steps (>= 50 ms) stopped: the ranks wait at the boundary
        if handle.status()["step"] != last:
            t0, last = time.time(), handle.status()["step"]
        assert not handle.done() and last < 12, handle.status()
        time.sleep(0.05)
    node = handle.controller.group.workers[2].info["node_id"]
    t_lost = time.time()
    cluster.remove(node)
    result = handle.result(timeout=180)
    rec = [e for e in result.events if e.kind == "recovered"]
    said = "\n".join(f"{e.time - t_lost:.1f} s {e.kind}: {e.message[:160]}"
                     for e in result.events)
    assert rec and rec[0].time - t_lost < 20, said
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)


def test_a_worker_lost_inside_a_step_leaves_no_trace_in_the_batch_norm_statistics(
        ray_cluster, tmp_path):
    """A BatchNorm model under dp on 2 workers; rank 1's process dies at the start of step
    12, after rank 0's forward of that step folded its samples into the running statistics.
    The survivor and a replacement run step 12 again from the state before it: the job ends
    equal to one without the failure, statistics and ``num_batches_tracked`` included. Was:
    the survivor kept the failed step's statistics (off by ~4e-3 at the end, the counter
    one batch ahead), copied to the replacement (found by a new user, session 49)."""
    ray_cluster(3)
    kw = dict(model=bn_mlp, num_workers=2, min_workers=2, max_workers=2, max_steps=20,
              replacement_timeout_s=60)
    clean = _submit(tmp_path / "clean", **kw).result(timeout=180)
    hurt = _submit(tmp_path / "hurt", faults=[{"rank": 1, "step": 12, "action": "exit"}],
                   **kw).result(timeout=180)
    rec = [e for e in hurt.events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["source"] == "peers", [
        (e.kind, e.message[:120]) for e in hurt.events]
    assert [h["world_size"] for h in hurt.history] == [2] * 20
    a, b = clean.state_dict(), hurt.state_dict()
    assert int(b["1.num_batches_tracked"]) == int(a["1.num_batches_tracked"]) == 20
    assert max_diff(b, a) < TOL


@pytest.mark.warm_workers
def test_hung_worker_is_cut_off_by_the_watchdog(ray_cluster, tmp_path, reference):
    """Rank 1 stops answering inside step 5 (the ``hang`` fault: once per run)."""
    ray_cluster(3)
    result = _submit(tmp_path, hang_timeout_s=4, replacement_timeout_s=1,
                     faults=[{"rank": 1, "step": 5, "action": "hang"}]).result(timeout=180)
    assert os.path.exists(os.path.join(result.run_dir, "faults", "fired-rank1-step5"))
    kinds = [e.kind for e in result.events]
    assert "hang" in kinds and "recovered" in kinds
    rec = next(e for e in result.events if e.kind == "recovered")
    # the hung rank's bundle is free again: a replacement may or may not start within 1 s
    assert rec.data["source"] == "peers" and rec.data["world_size"] in (2, 3)
    assert max_diff(result.state_dict(), reference[0]) < TOL


@pytest.mark.warm_workers
def test_a_slow_step_is_no_loss(ray_cluster, tmp_path, reference):
    """Rank 1's step 5 takes 2 s (the ``slow`` fault, as a straggler or an emulated slow
    device), 7x the silence that makes a worker suspect: its peer waits in its collective,
    and nothing takes either for lost (no failure, no recovery, the same processes and
    generation throughout)."""
    ray_cluster(2)
    handle = _submit(tmp_path, num_workers=2, max_workers=2, heartbeat_timeout_s=0.3,
                     faults=[{"rank": 1, "step": 5, "action": "slow", "seconds": 2.0}])
    result = handle.result(timeout=180)
    assert os.path.exists(os.path.join(result.run_dir, "faults", "fired-rank1-step5"))
    kinds = {e.kind for e in result.events}
    assert not kinds & {"failure", "recovered", "hang", "joined"}, kinds
    assert {h["generation"] for h in result.history} == {1}
    assert {h["world_size"] for h in result.history} == {2}
    times = {h["step"]: h["time"] for h in result.history}
    assert times[5] - times[4] >= 1.9  # the step was slow indeed
    assert max_diff(result.state_dict(), reference[0]) < TOL
