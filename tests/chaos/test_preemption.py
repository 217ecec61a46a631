"""Announced and unannounced node losses on a real multi-node Ray cluster
(``ray.cluster_utils.Cluster``): a drain through Ray's own drain path (the GCS call ``ray
drain-node`` makes, a preemption with a deadline), the node removed at its deadline, the job
evacuated at a step boundary in every layout, and a loss under zero3 restored from the
buddies' copies. Every run ends with the parameters of the uninterrupted single-process
reference. Marked ``chaos``; CI runs them."""

from __future__ import annotations

import functools
import time

import pytest

from elastic.reference import reference_train
from tests.chaos import test_chaos
from tests.chaos.test_chaos import STEPS, TOL, G, _check_data_log, _wait_paused, _wait_step
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

pytestmark = pytest.mark.chaos


def _submit(tmp_path, **kw):
    """``test_chaos._submit`` on the slow loss: a drain is acted on between steps, and the
    job must still be running when the notice comes (``_wait_step``)."""
    return test_chaos._submit(tmp_path, **{"loss": test_chaos._slow_mse, **kw})


@pytest.fixture(scope="module")
def reference():
    return reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)


LONG = 150  # steps (~15 s): a job still running when a replacement is up, or the deadline


@functools.cache
def _long_reference() -> dict:
    return reference_train(mlp, adam, mse, RegressionData(), G, LONG, seed=0)[0]


def _drain(node_id: str, deadline_s: float, why: str = "spot instance reclaimed (test)") -> float:
    """Drain ``node_id`` as a cloud's preemption does, through Ray's own path (the GCS call
    of ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds``).
    Returns the deadline (seconds since the epoch)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline = time.time() + deadline_s
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    ok, msg = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(
        "DRAIN_NODE_REASON_PREEMPTION"), why, int(deadline * 1000))
    assert ok, msg
    return deadline


def _remove_at(cluster, handle, node_id: str, deadline: float) -> None:
    """The cloud takes the node at its deadline (from this, the main thread: cluster_utils
    installs signal handlers), or, when the job has ended before it, at once: nothing of the
    job can be on it any more, and the test need not sit out the rest of the deadline."""
    while time.time() < deadline and not handle.done():
        time.sleep(0.02)
    cluster.remove(node_id)


def _evacuate_and_check(cluster, handle, reference, rank: int, deadline_s: float):
    _wait_step(handle, 6)
    ctl = handle.controller
    node = ctl.workers[rank].info["node_id"]
    survivors = {w.info["pid"] for w in ctl.workers if w.info["node_id"] != node}
    deadline = _drain(node, deadline_s)
    _remove_at(cluster, handle, node, deadline)
    result = handle.result(timeout=240)
    kinds = [e.kind for e in result.events]
    notice = next(e for e in result.events if e.kind == "preemption_notice")
    assert notice.data["node"] == node and notice.data["ranks"] == [rank]
    assert notice.data["reason"] == "preemption" and 0 < notice.data["left_s"] <= deadline_s
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)
    return result, kinds, survivors


@pytest.mark.warm_workers
def test_zero3_drain_is_evacuated_at_a_step_boundary_without_a_lost_step(ray_cluster, tmp_path,
                                                                         reference):
    cluster = ray_cluster(3)
    handle = _submit(tmp_path, strategy="zero3", max_workers=3)
    result, kinds, survivors = _evacuate_and_check(cluster, handle, reference, 2, 8.0)
    ev = next(e for e in result.events if e.kind == "evacuated")
    assert ev.data["path"] == "move" and ev.data["steps_lost"] == 0, ev.message
    assert ev.data["state_preserved"] and ev.data["handed_bytes"] > 0
    assert ev.data["left_at_release_s"] > 4  # released long before the deadline
    assert set(ev.data["pids"]) == survivors  # nobody restarted
    # no checkpoint read, no recovery: the node went after it had been emptied
    assert not {"recovered", "restored", "resumed", "failure"} & set(kinds), kinds
    assert result.history[-1]["world_size"] == 2


@pytest.mark.warm_workers
def test_pipeline_x_zero2_drain_is_evacuated_without_a_lost_step(ray_cluster, tmp_path,
                                                                 reference):
    cluster = ray_cluster(4)
    handle = _submit(tmp_path, strategy="pipeline", pp_degree=2, dp_mode="zero2",
                     num_workers=4, min_workers=2, max_workers=4)
    result, kinds, survivors = _evacuate_and_check(cluster, handle, reference, 3, 8.0)
    ev = next(e for e in result.events if e.kind == "evacuated")
    assert ev.data["path"] == "move" and ev.data["steps_lost"] == 0, ev.message
    assert ev.data["state_preserved"] and set(ev.data["pids"]) == survivors
    assert not {"recovered", "restored", "resumed", "failure"} & set(kinds), kinds
    assert result.history[-1]["world_size"] == 3


@pytest.mark.warm_workers
def test_zero3_loss_without_notice_recovers_from_the_buddies_copies(ray_cluster, tmp_path,
                                                                    reference):
    """Rank 1 pauses at the start of step 7 and its node goes, unannounced: the survivors'
    memory holds every entry as of the last copy (every 5 steps: step 5); no storage is
    read. The re-formed group takes a copy at its first step boundary (step 6), so a second
    unannounced loss at the start of step 9, before the next multiple of 5, comes back from
    the buddies too, not from scratch (no checkpoints here)."""
    cluster = ray_cluster(3)
    faults = str(tmp_path / "faults")
    handle = _submit(tmp_path, strategy="zero3", peer_copies_every=5,
                     faults=[{"rank": 1, "step": 7, "action": "pause", "dir": faults},
                             {"rank": 1, "step": 9, "action": "pause", "dir": faults}])
    paused = _wait_paused(handle, f"{faults}/paused-rank1-step7.json")
    t0 = time.time()
    cluster.remove(paused["node_id"])
    paused = _wait_paused(handle, f"{faults}/paused-rank1-step9.json")
    cluster.remove(paused["node_id"])
    result = handle.result(timeout=240)
    said = [f"{e.time - t0:.2f} {e.kind}: {e.message[:200]}" for e in result.events]
    recs = [e for e in result.events if e.kind == "recovered"]
    assert [(r.data["source"], r.step) for r in recs] == [("buddies", 5), ("buddies", 6)], said
    # steps 5-6 and 6-8 at most (the step whose agreement had not come back is not counted)
    assert all(0 < r.data["steps_lost"] <= 3 for r in recs), said
    fail = next(e for e in result.events if e.kind == "failure")
    assert fail.time - fail.data["detect_s"] - t0 < 3.0  # noticed quickly
    assert max_diff(result.state_dict(), reference[0]) < TOL
    _check_data_log(result.run_dir, result.history)


@pytest.mark.warm_workers
def test_a_drain_with_too_short_a_deadline_falls_back_cleanly(ray_cluster, tmp_path, reference):
    """3 s left, 5 s to be kept in reserve: no move is safe; the node is let go at once and
    the job recovers from the buddies' copies, saying so; the node is removed at its
    deadline."""
    cluster = ray_cluster(3)
    handle = _submit(tmp_path, strategy="zero3", peer_copies_every=2, drain_poll_s=0.2,
                     evacuation_slack_s=5.0)
    result, kinds, _ = _evacuate_and_check(cluster, handle, reference, 1, 3.0)
    ev = next(e for e in result.events if e.kind in ("evacuating", "preemption_missed"))
    if ev.kind == "evacuating":  # the boundary came before the deadline
        assert ev.data["path"] == "recover" and "buddies' copies" in ev.message
        done = next(e for e in result.events if e.kind == "evacuated")
        said = [f"{e.step} {e.kind}: {e.message[:300]}" for e in result.events]
        # copies every 2 steps; the newest is missing while its exchange, or the agreement
        # on the one before (read a step after it), is still out: one step more (a loaded
        # host: the boundary at 25, copies of 22)
        assert done.data["source"] == "buddies" and done.data["steps_lost"] <= 3, said
    else:  # the node went first: a loss, recovered the same way
        rec = next(e for e in result.events if e.kind == "recovered")
        assert rec.data["source"] == "buddies"


@pytest.mark.warm_workers
def test_a_drain_below_min_workers_takes_in_a_replacement_then_moves_the_state(
        ray_cluster, tmp_path, reference):
    """min_workers=3 on 3 nodes, a fourth joining as the notice comes: the survivors alone
    would be too few, so the job places a replacement first (never on the draining node),
    takes it in while the draining rank still holds its shards, then moves that rank's
    state onto the others and lets it go: no step lost, no checkpoint, 3 workers, the
    survivors' processes kept. Was: a checkpoint, the node let go, and a recovery that
    waited below min_workers. Each worker in a group of its own (``per_worker``): once the
    node has gone, the drained worker's group, which Ray holds for re-reserving, is given
    back (the job at its size cannot use it; was: held for the rest of the run)."""
    import ray

    cluster = ray_cluster(3)
    handle = _submit(tmp_path, strategy="zero3", min_workers=3, max_workers=3,
                     min_workers_timeout_s=90, checkpoint_every=100, max_steps=LONG,
                     checkpoint_uri=str(tmp_path / "ckpt"), placement="per_worker",
                     scale_check_s=0.5)
    _wait_step(handle, 6)
    ctl = handle.controller
    node = ctl.workers[2].info["node_id"]
    kept = {w.info["pid"] for w in ctl.workers if w.info["node_id"] != node}
    _drain(node, 30.0)
    cluster.add_node()  # room for the replacement
    while not handle.done() and not any(e.kind == "evacuated" for e in list(ctl.events)):
        time.sleep(0.05)
    cluster.remove(node)  # taken early, as soon as nothing of the job is on it
    held = None
    while not handle.done() and held != 3:  # the groups the job holds: its workers' alone
        held = sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())
        time.sleep(0.1)
    result = handle.result(timeout=240)
    assert held == 3, held
    said = [f"{e.step} {e.kind}: {e.message[:160]}" for e in result.events if e.kind != "state"]
    assert any(e.kind == "replacing" for e in result.events), said
    paths = [e.data["path"] for e in result.events if e.kind == "evacuating"]
    assert paths == ["replace", "move"], said
    done = next(e for e in result.events if e.kind == "evacuated")
    assert done.data["path"] == "move" and done.data["steps_lost"] == 0, said
    assert done.data["world_size"] == 3 and kept <= set(done.data["pids"]), said
    assert node not in {w.info["node_id"] for w in ctl.workers}
    assert not {"recovered", "failure"} & {e.kind for e in result.events}, said
    assert len(result.history) == LONG
    assert max_diff(result.state_dict(), _long_reference()) < TOL
    _check_data_log(result.run_dir, result.history, LONG)


@pytest.mark.warm_workers
def test_a_drain_below_min_workers_checkpoints_then_recovers_on_a_new_node(
        ray_cluster, tmp_path, reference):
    """min_workers=3 on 3 nodes and no room for a replacement until the node has gone: the
    job waits for one while it can still checkpoint in time, then takes a checkpoint at the
    boundary, lets the node go, and recovers from that checkpoint on a node that joins: no
    step lost. The checkpoint is taken on the group whose upload in flight the evacuation
    has just given up; an earlier change voided every report of that group's checkpoints
    there, this one's too, and the recovery went back to step 0."""
    cluster = ray_cluster(3)
    handle = _submit(tmp_path, strategy="zero3", min_workers=3, max_workers=3,
                     min_workers_timeout_s=90, checkpoint_every=500, max_steps=LONG,
                     checkpoint_uri=str(tmp_path / "ckpt"))
    _wait_step(handle, 6)
    node = handle.controller.workers[2].info["node_id"]
    deadline = _drain(node, 12.0)
    _remove_at(cluster, handle, node, deadline)
    cluster.add_node()  # the replacement the recovery waits for
    result = handle.result(timeout=240)
    said = [f"{e.kind}: {e.message[:160]}" for e in result.events if e.kind != "state"]
    # replacements asked for at the notice, training on; none up within the wait
    assert [e.kind for e in result.events if e.kind in ("replacing", "replacement_missing")
            ] == ["replacing", "replacement_missing"], said
    ev, = [e for e in result.events if e.kind == "evacuating"]
    assert ev.data["path"] == "checkpoint" and "min_workers" in ev.message, said
    done = next(e for e in result.events if e.kind == "evacuated")
    ck = [e.data["step"] for e in result.events if e.kind == "checkpoint"]
    assert done.data["source"] == "checkpoint" and done.data["steps_lost"] == 0, said
    assert ck[0] == done.data["step"], said
    assert max_diff(result.state_dict(), _long_reference()) < TOL
    _check_data_log(result.run_dir, result.history, LONG)


def test_a_warm_pool_never_hands_out_a_worker_on_a_draining_node(ray_cluster, tmp_path):
    """A pool keeps one idle worker on each of 2 nodes; one node gets a preemption notice.
    The next job takes the worker on the other node, and the pool retires the one on the
    draining node (handing it out would only make the job evacuate it)."""
    import ray

    from clusters.pool_policy import DRAINING
    from elastic.control.pool import WorkerPool

    ray_cluster(2)
    pool = WorkerPool(2, max_idle=2)
    try:
        node_of = {a["Pid"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                   if a.get("State") == "ALIVE"}
        pids = pool.info()["idle_pids"]
        assert len(pids) == 2 and len({node_of[p] for p in pids}) == 2
        _drain(node_of[pids[0]], 60.0)
        result = _submit(tmp_path, num_workers=1, min_workers=1, max_workers=1, max_steps=3,
                         loss=mse, pool=pool).result(timeout=120)
        assert result.status == "finished"
        assert not {"failure", "recovered", "evacuating"} & {e.kind for e in result.events}
        info = pool.info()
        assert info["retired"] == {DRAINING: 1}, info
        assert info["idle_pids"] == [pids[1]], info  # the job's worker came back
        assert info["handed_out"] == 1 and info["cold"] == 0, info
    finally:
        pool.close()


def test_a_pool_between_jobs_retires_its_worker_on_a_draining_node_and_refills_elsewhere(
        ray_cluster):
    """No job asks the pool anything: its own watch sees the drain, retires the idle worker
    on the draining node before the node goes, and starts its replacement on a node that is
    not draining, so the next job finds the pool full."""
    import ray

    from clusters.pool_policy import DRAINING
    from elastic.control.pool import WorkerPool
    from elastic.ray_connect import free_by_node

    ray_cluster(3)
    pool = WorkerPool(2, max_idle=2, maintain_every_s=0.5)
    try:
        def nodes_of(pids):
            node_of = {a["Pid"]: a["Address"]["NodeID"]
                       for a in ray._private.state.actors().values() if a.get("State") == "ALIVE"}
            return [node_of[p] for p in pids]

        pids = pool.info()["idle_pids"]
        assert len(pids) == 2
        drained = nodes_of(pids)[0]
        _drain(drained, 60.0)
        t0 = time.monotonic()
        while True:
            info = pool.info()
            if info["retired"] and len(info["idle_pids"]) == 2:
                break
            assert time.monotonic() - t0 < 30, info
            time.sleep(0.1)
        assert info["retired"] == {DRAINING: 1}, info
        assert pids[1] in info["idle_pids"] and pids[0] not in info["idle_pids"], info
        assert drained not in nodes_of(info["idle_pids"]), info
        assert info["handed_out"] == 0, info
        # the drained node's CPU is free again, but Ray reports none there (it places
        # nothing on a draining node), so a job's room estimate does not count it
        assert all(f["CPU"] < 1 for f in free_by_node({"CPU": 1}).values())
    finally:
        pool.close()
