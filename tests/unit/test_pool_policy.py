"""clusters.pool_policy: the warm pool's decision table (pure: no Ray, no clock)."""

from __future__ import annotations

import pytest

from clusters.pool_policy import (
    DRAINING,
    ROOM,
    IdleWorker,
    PoolDecision,
    PoolKey,
    PoolObservation,
    PoolPolicy,
    Returned,
    Want,
    fitting,
    room_of,
)

CPU1 = PoolKey.of({"CPU": 1}, False)
CPU2 = PoolKey.of({"CPU": 2}, False)
GPU1 = PoolKey.of({"CPU": 1, "GPU": 1}, True)
ENV = PoolKey.of({"CPU": 1}, False, {"env_vars": {"X": "1"}})


def idle(i: int, key: PoolKey = CPU1, node: str = "a", since: float = 0.0, **kw) -> IdleWorker:
    return IdleWorker(i, key, node, since, **kw)


def policy(**kw) -> PoolPolicy:
    return PoolPolicy(CPU1, **kw)


def test_key_of_is_canonical():
    assert PoolKey.of({"CPU": 1, "GPU": 0}, False) == PoolKey.of({"CPU": 1.0}, False, {})
    assert PoolKey.of({"CPU": 1}, False, None) == PoolKey.of({"CPU": 1}, False, {})
    assert len({CPU1, CPU2, GPU1, ENV}) == 4
    assert PoolKey.of({"CPU": 1}, False, {"a": 1, "b": 2}) == PoolKey.of({"CPU": 1}, False,
                                                                          {"b": 2, "a": 1})
    assert "CPU=1" in CPU1.describe() and "gpu" in GPU1.describe() and "X" in ENV.describe()


@pytest.mark.parametrize("key, n, expect", [
    (CPU1, 2, (1, 2)),        # same key: handed out
    (CPU1, 5, (1, 2)),        # fewer than asked: the rest cold
    (CPU2, 1, ()),            # another resource shape: never
    (GPU1, 1, ()),            # another device kind: never
    (ENV, 1, ()),             # another runtime environment: never
    (CPU1, 0, ()),
])
def test_hand_out_only_the_same_key(key, n, expect):
    obs = PoolObservation(10.0, (idle(1), idle(2)), want=Want(key, n, free_bundles=8))
    assert policy().decide(obs).hand_out == expect


def test_hand_out_packs_one_node_then_most_recent():
    ws = (idle(1, node="a", since=1), idle(2, node="b", since=5), idle(3, node="b", since=2),
          idle(4, node="c", since=9))
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 2, 8)))
    assert d.hand_out == (2, 3)  # node b holds two; the later returned first
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 1, 8)))
    assert d.hand_out == (2,)


def test_dead_idle_worker_is_retired_and_never_handed_out():
    ws = (idle(1, alive=False), idle(2))
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 2, 8)))
    assert d.hand_out == (2,)
    assert d.retired() == {1: "died while idle"}


@pytest.mark.parametrize("ret, kept, why", [
    (Returned(1, CPU1, "a"), True, None),
    (Returned(1, CPU1, "a", alive=False), False, "died"),
    (Returned(1, CPU1, "a", reset_ok=False), False, "reset failed"),
    (Returned(1, CPU1, "a", user_error=True), False, "user code"),
    (Returned(1, CPU1, "a", leaked_threads=2), False, "thread"),
    # a training segment of its ended job still ran after its group was gone (session 43)
    (Returned(1, CPU1, "a", segment_ran=True), False, "segment of its job still ran"),
    # its GPU job kept memory alive past the reset (was reported and ignored, session 43);
    # a few MiB past the process's own at its start pass
    (Returned(1, CPU1, "a", cuda_left=3 * 2**30), False, "memory allocated on the GPU"),
    (Returned(1, CPU1, "a", cuda_left=2**20), True, None),
    (Returned(1, CPU1, "a", jobs=3), False, "served 3 jobs"),
    (Returned(1, CPU1, "a", jobs=2), True, None),
])
def test_returned_workers_kept_or_retired(ret, kept, why):
    d = policy(max_jobs=3).decide(PoolObservation(10.0, returned=(ret,)))
    assert (d.keep == (1,)) is kept
    if why is None:
        assert not d.retire
    else:
        assert why in d.retired()[1]


def test_returned_worker_serves_the_next_job_at_once():
    d = policy().decide(PoolObservation(10.0, returned=(Returned(7, CPU1, "a"),),
                                        want=Want(CPU1, 1, 0)))
    assert d.keep == (7,) and d.hand_out == (7,)
    d = policy().decide(PoolObservation(10.0, returned=(Returned(7, CPU1, "a", user_error=True),),
                                        want=Want(CPU1, 1, 0)))
    assert d.hand_out == () and 7 in d.retired()


def test_idle_timeout():
    ws = (idle(1, since=0.0), idle(2, since=50.0))
    d = policy(idle_timeout_s=60).decide(PoolObservation(100.0, ws))
    assert list(d.retired()) == [1] and "idle for more" in d.retired()[1]


def test_idle_timeout_spares_the_pools_own_min_idle():
    """A pool that keeps 2 warm does not retire them for idling (it would start them again
    at once, and its watch decides every few seconds): only those beyond min_idle, and other
    keys' workers, time out."""
    ws = (idle(1, since=0.0), idle(2, since=10.0), idle(3, since=50.0), idle(4, CPU2, since=0.0))
    d = policy(min_idle=2, idle_timeout_s=60).decide(PoolObservation(100.0, ws))
    assert sorted(d.retired()) == [1, 4] and d.start == 0  # 2 stays: the more recent
    d = policy(min_idle=1, idle_timeout_s=60).decide(PoolObservation(100.0, ws))
    assert sorted(d.retired()) == [1, 2, 4] and d.start == 0  # 3 has not timed out
    d = policy(min_idle=3, idle_timeout_s=60).decide(PoolObservation(100.0, ws))
    assert sorted(d.retired()) == [4] and d.start == 0
    d = policy(min_idle=0, idle_timeout_s=60).decide(PoolObservation(100.0, ws))
    assert sorted(d.retired()) == [1, 2, 4]


def test_no_refill_while_a_job_places_the_workers_it_starts_cold():
    """A hand-out left a job 1 worker to start cold; until it is placed, a decision of the
    pool's watch (no job asking) starts no refill: the refill would take its room (the
    scheduler's 3 CPUs with 2 warm: its 3-worker job waited 60 s, then failed)."""
    obs = PoolObservation(10.0, (), lent=2, cold_pending=1)
    d = policy(min_idle=2).decide(obs)
    assert d.start == 0 and any("waits" in r for r in d.reasons), d
    assert policy(min_idle=2).decide(PoolObservation(10.0, (), lent=2)).start == 2
    assert policy(min_idle=2, max_total=3).decide(PoolObservation(10.0, (), lent=2)).start == 1


def test_max_idle_retires_the_longest_idle():
    ws = tuple(idle(i, since=float(i)) for i in range(1, 6))
    d = policy(max_idle=3).decide(PoolObservation(10.0, ws))
    assert sorted(d.retired()) == [1, 2]
    d = policy(max_idle=3).decide(PoolObservation(10.0, ws, want=Want(CPU1, 2, 8)))
    assert not d.retire  # two go out: three stay idle


@pytest.mark.parametrize("max_total", [4, None])
def test_max_idle_retires_other_keys_before_the_pools_own_min_idle(max_total):
    """A pool keeping 4 warm (max_idle 4) gets back a worker of another key (a job's that
    started cold): that one goes, the pool's own four stay, and nothing starts. Was: its own
    longest idle went (spared by the idle timeout, they are the longest idle), and the
    refill was 0 at max_total (the pool ran short) or 1 without (retire one, start one)."""
    ws = tuple(idle(i, since=float(i)) for i in range(1, 5))
    p = policy(min_idle=4, max_idle=4, max_total=max_total)
    d = p.decide(PoolObservation(100.0, ws, returned=(Returned(9, CPU2, "n"),)))
    assert list(d.retired()) == [9] and d.start == 0, d
    # own workers beyond min_idle go before its min_idle, the longest idle first
    ws5 = ws + (idle(5, since=5.0), idle(6, CPU2, since=6.0))
    d = policy(min_idle=3, max_idle=3).decide(PoolObservation(100.0, ws5))
    assert sorted(d.retired()) == [1, 2, 6]


def test_cold_workers_make_room_by_retiring_other_keys():
    ws = (idle(1, CPU2, since=1), idle(2, GPU1, since=0), idle(3, CPU1, since=2))
    # one warm (3), two cold; one bundle free: one other-key worker goes, the longest idle
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 3, free_bundles=1)))
    assert d.hand_out == (3,)
    assert list(d.retired()) == [2] and "room" in d.retired()[2]
    # enough room: nobody retired
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 3, free_bundles=2)))
    assert not d.retire


def test_bundles_left_to_earlier_cold_starts_count_as_taken():
    """Two jobs ask at once and both see the one free bundle: the first was left to start 1
    cold there (``cold_pending``), so the second's cold worker finds none and an other-key
    idle worker makes room (without the count, neither asked for room and the second waited
    out its placement timeout)."""
    ws = (idle(1, CPU2, since=1),)
    first = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 1, free_bundles=1)))
    assert not first.retire and first.room_short == ()
    second = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 1, free_bundles=1),
                                             cold_pending=1))
    assert list(second.retired()) == [1] and second.room_short == ()


@pytest.mark.parametrize("idle_keys, free, pending, short", [
    ((CPU2,), 0, 0, 0),          # a 2-CPU worker of another key frees room for both
    ((ENV,), 0, 0, 1),           # a 1-CPU one for one: one bundle still missing
    ((), 0, 0, 2),               # nothing of this pool can go: both missing
    ((CPU2, GPU1, ENV), 0, 0, 0),  # enough other keys here (two retired)
    ((), 2, 0, 0),               # free bundles for both
    ((), 2, 1, 1),               # one of them promised to an earlier cold start
    ((CPU1,), 0, 0, 1),          # the same key is handed out, not retired: one cold, missing
])
def test_what_this_pool_cannot_free_is_room_short(idle_keys, free, pending, short):
    ws = tuple(idle(i, k, since=float(i)) for i, k in enumerate(idle_keys, 1))
    d = policy().decide(PoolObservation(10.0, ws, want=Want(CPU1, 2, free_bundles=free),
                                        cold_pending=pending))
    assert d.room_short == room_of(CPU1, short), d


def test_room_for_another_pools_job_retires_the_longest_idle_of_any_key():
    """Another pool of the process has a job whose cold workers find no free resources:
    ``room`` idle workers go, longest idle first, whatever their key, the pool's own
    ``min_idle`` too (a job waiting comes before a cache), and no refill takes the room back
    in the same decision."""
    ws = (idle(1, CPU1, since=5), idle(2, CPU2, since=1), idle(3, CPU1, since=3))
    d = policy(min_idle=3).decide(PoolObservation(10.0, ws, room=(("CPU", 3.0),)))
    assert d.retired() == {2: ROOM, 3: ROOM} and d.start == 0 and d.room_short == (), d
    d = policy().decide(PoolObservation(10.0, ws, room=(("CPU", 5.0),)))
    assert sorted(d.retired()) == [1, 2, 3] and d.room_short == (("CPU", 1.0),)
    assert not policy().decide(PoolObservation(10.0, ws)).retire  # no room asked: all stay


def test_room_is_counted_in_resources_not_workers():
    """A job of 4-CPU bundles short of one bundle needs four 1-CPU workers gone, not one
    (counted in workers, one was retired, 3 CPUs stayed held, and the job waited out its
    placement timeout); a worker that holds none of what is lacking is not retired."""
    cpu4 = PoolKey.of({"CPU": 4}, False)
    ws = tuple(idle(i, CPU1, since=float(i)) for i in range(1, 6))
    d = PoolPolicy(cpu4).decide(PoolObservation(10.0, ws, want=Want(cpu4, 1, free_bundles=0)))
    assert sorted(d.retired()) == [1, 2, 3, 4] and d.room_short == (), d
    # this pool holds 2 CPUs of other keys: the other pools are asked for the other 6
    d = PoolPolicy(cpu4).decide(PoolObservation(10.0, ws[:2], want=Want(cpu4, 2)))
    assert sorted(d.retired()) == [1, 2] and d.room_short == (("CPU", 6.0),), d
    # longest idle first until covered: a 1-CPU worker, then a 2-CPU one (1 CPU lacked)
    ws2 = (idle(1, CPU1, since=0), idle(2, CPU2, since=1), idle(3, CPU1, since=2))
    d = policy().decide(PoolObservation(10.0, ws2, room=(("CPU", 2.0),)))
    assert sorted(d.retired()) == [1, 2] and d.room_short == ()
    d = policy().decide(PoolObservation(10.0, (idle(2, CPU2),), room=(("CPU", 2.0),)))
    assert d.retired() == {2: ROOM} and d.room_short == ()
    # a GPU job lacks a GPU: CPU-only workers hold none of it and stay
    gpu_only = (("GPU", 1.0),)
    d = policy().decide(PoolObservation(10.0, ws, room=gpu_only))
    assert not d.retire and d.room_short == gpu_only
    d = policy().decide(PoolObservation(10.0, ws + (idle(9, GPU1, since=20.0),), room=gpu_only))
    assert d.retired() == {9: ROOM} and d.room_short == ()
    assert room_of(cpu4, 2) == (("CPU", 8.0),) and room_of(cpu4, 0) == ()


def test_what_is_free_is_not_lacking():
    """Counted from each node's free resources: a GPU job whose CPU is free lacks the GPU
    only, so a CPU-only idle worker stays (a whole bundle's CPU counted as lacking retired
    it for nothing); with 1 CPU free on a node, a 2-CPU bundle needs one 1-CPU worker of
    that node retired; a 4-CPU bundle goes to the node where the fewest must go, not to
    CPUs freed one per node (which host no bundle)."""
    cpu_only = (idle(1, CPU1, since=0.0), idle(2, CPU2, since=1.0))
    gpu_job = Want(GPU1, 1, free_bundles=0, free=(("a", (("CPU", 3.0), ("GPU", 0.0))),))
    d = policy().decide(PoolObservation(10.0, cpu_only, want=gpu_job))
    assert not d.retire and d.room_short == (("GPU", 1.0),), d
    gpu_other_env = PoolKey.of({"CPU": 1, "GPU": 1}, True, {"env_vars": {"Y": "1"}})
    d = policy().decide(PoolObservation(10.0, cpu_only + (idle(3, gpu_other_env, since=5.0),),
                                        want=gpu_job))
    assert d.retired() == {3: f"room for a job of {GPU1.describe()}"} and d.room_short == ()
    ws = tuple(idle(i, CPU1, since=float(i)) for i in range(1, 4))  # all on node "a"
    two = Want(CPU2, 1, free_bundles=0, free=(("a", (("CPU", 1.0),)),))
    d = PoolPolicy(CPU2).decide(PoolObservation(10.0, ws, want=two))
    assert sorted(d.retired()) == [1] and d.room_short == (), d
    # 1 CPU free on each of a and b: one worker of a frees the second CPU there
    spread = Want(CPU2, 1, free_bundles=0, free=(("a", (("CPU", 1.0),)), ("b", (("CPU", 1.0),))))
    d = PoolPolicy(CPU2).decide(PoolObservation(10.0, ws, want=spread))
    assert sorted(d.retired()) == [1] and d.room_short == (), d
    # an earlier cold start (counted in this shape) claims 2 of the 3 free CPUs of a:
    # the job's 2 bundles need 3 more, so all three go
    d = PoolPolicy(CPU2).decide(PoolObservation(
        10.0, ws, want=Want(CPU2, 2, free_bundles=1, free=(("a", (("CPU", 3.0),)),)),
        cold_pending=1))
    assert sorted(d.retired()) == [1, 2, 3] and d.room_short == (), d
    # 8-CPU nodes with 1 CPU free each; a 4-CPU bundle: the 3 workers of node b go (with
    # b's free CPU, 4), not the longest idle worker of a (totals: 3 free, 1 "lacking")
    cpu4 = PoolKey.of({"CPU": 4}, False)
    nodes = (idle(1, CPU1, "a", 0.0), idle(2, CPU1, "a", 1.0), idle(3, CPU1, "b", 2.0),
             idle(4, CPU1, "b", 3.0), idle(5, CPU1, "b", 4.0), idle(6, CPU1, "c", 5.0))
    free = tuple((n, (("CPU", 1.0),)) for n in "abc")
    d = PoolPolicy(cpu4).decide(PoolObservation(10.0, nodes, want=Want(cpu4, 1, 0, free)))
    assert sorted(d.retired()) == [3, 4, 5] and d.room_short == (), d
    # no node can be made to hold one: what is lacking goes to the other pools
    d = PoolPolicy(cpu4).decide(PoolObservation(10.0, nodes[:2], want=Want(cpu4, 1, 0, free)))
    assert not d.retire and d.room_short == (("CPU", 1.0),), d
    # free enough in total (4) but spread over nodes, nothing here to retire: whole bundle
    d = PoolPolicy(cpu4).decide(PoolObservation(10.0, (), want=Want(
        cpu4, 1, 0, tuple((n, (("CPU", 1.0),)) for n in "abcd"))))
    assert d.room_short == (("CPU", 4.0),), d
    # how many bundles the nodes hold: node by node, never from the totals
    assert fitting(CPU2, (("a", (("CPU", 3.0),)), ("b", (("CPU", 1.0),)))) == 1
    assert fitting(GPU1, (("a", (("CPU", 8.0), ("GPU", 0.0))),)) == 0
    assert fitting(GPU1, (("a", (("CPU", 8.0), ("GPU", 2.0))),)) == 2


def test_no_refill_while_room_made_for_another_pools_job_is_held():
    """After making room, the pool's watch would start its ``min_idle`` again within 5 s and
    could take the room back before the other job asks for its bundles (it first waits for
    its warm workers): while ``room_held``, no refill."""
    d = policy(min_idle=2).decide(PoolObservation(10.0, (), room_held=True))
    assert d.start == 0 and any("waits" in r for r in d.reasons), d
    assert policy(min_idle=2).decide(PoolObservation(10.0, ())).start == 2


def test_min_idle_starts_ahead_of_demand_within_max_total():
    p = policy(min_idle=2, max_total=4)
    assert p.decide(PoolObservation(0.0)).start == 2
    assert p.decide(PoolObservation(0.0, starting=2)).start == 0
    assert p.decide(PoolObservation(0.0, (idle(1),))).start == 1
    assert p.decide(PoolObservation(0.0, (idle(1, CPU2),))).start == 2  # not its key
    # two handed out of two: refilled while the total stays within 4
    d = p.decide(PoolObservation(0.0, (idle(1), idle(2)), want=Want(CPU1, 2, 0)))
    assert d.hand_out == (1, 2) and d.start == 2
    d = p.decide(PoolObservation(0.0, (idle(1), idle(2)), want=Want(CPU1, 2, 0), lent=2))
    assert d.start == 0  # 2 lent + 2 handed out = 4
    assert PoolPolicy(CPU1, min_idle=2).decide(PoolObservation(0.0, lent=100)).start == 2


@pytest.mark.parametrize("max_total", [3, None])
def test_no_refill_competes_with_the_workers_a_job_starts_cold(max_total):
    """A scheduler owning 3 CPUs with 2 warm workers: its first job asks for 3, gets the 2
    and starts 1 cold. A refill started then took the last CPU, and the job failed after its
    60 s placement timeout ("cannot host 1 workers")."""
    p = policy(min_idle=2, max_idle=3, max_total=max_total)
    d = p.decide(PoolObservation(0.0, (idle(1), idle(2)), want=Want(CPU1, 3, free_bundles=1)))
    assert d.hand_out == (1, 2) and d.start == 0, d
    if max_total is None:  # (with max_total=3 the cold one already counts toward it)
        assert any("refill 0 of 2" in r for r in d.reasons), d.reasons
    # room beyond the cold ones: the refill takes only that (a bigger cluster keeps warming)
    big = policy(min_idle=2, max_idle=3, max_total=None if max_total is None else 8)
    d = big.decide(PoolObservation(0.0, (idle(1), idle(2)), want=Want(CPU1, 3, 6)))
    assert d.start == 2, d
    d = big.decide(PoolObservation(0.0, (idle(1), idle(2)), want=Want(CPU1, 3, 2)))
    assert d.start == 1, d
    # a job of another shape: its room cannot be compared with the pool's own, no refill
    d = big.decide(PoolObservation(0.0, (), want=Want(CPU2, 1, 6)))
    assert d.start == 0, d
    # once the job holds all 3 (lent), nothing starts while the total is at max_total; with
    # no bound the pool refills as before
    d = p.decide(PoolObservation(0.0, lent=3))
    assert d.start == (0 if max_total else 2)


def test_decision_defaults_and_bad_settings():
    assert policy().decide(PoolObservation(0.0)) == PoolDecision()
    with pytest.raises(ValueError):
        PoolPolicy(CPU1, max_jobs=0)
    with pytest.raises(ValueError):
        PoolPolicy(CPU1, min_idle=-1)


@pytest.mark.parametrize("gpus, asked, want", [
    (8.0, None, (True, {"CPU": 1, "GPU": 1.0})),   # a GPU cluster: GPU workers, as jobs get
    (0.0, None, (False, {"CPU": 1})),
    (8.0, False, (False, {"CPU": 1})),
    (0.0, True, (True, {"CPU": 1, "GPU": 1.0})),
])
def test_a_pools_workers_are_the_shape_jobs_on_that_cluster_get(monkeypatch, gpus, asked, want):
    """``WorkerPool(use_gpu=None)`` (the default, and what `elastic scheduler start --gpus`
    gives) decides as a job's placement does: on a cluster with GPUs its workers hold one.
    A CPU pool there matched no job (``PoolKey`` differs), so every job started cold while
    the idle CPU workers held CPUs. The pool and a job's placement share the decision
    (``ray_connect.worker_bundle``). Ray is stood in for: the pool starts nothing (size 0)."""
    from elastic.control import pool as pool_mod

    monkeypatch.setattr(pool_mod, "connect", lambda address, cpus, say=None: False)
    monkeypatch.setattr("elastic.ray_connect.cluster_has_gpus", lambda: gpus > 0)
    monkeypatch.setattr(pool_mod, "runtime_env_now", lambda: {})
    p = pool_mod.WorkerPool(0, use_gpu=asked, wait=False)
    assert (p.use_gpu, p.bundle) == want
    assert p.key == PoolKey.of(want[1], want[0], {})


def test_a_worker_on_a_draining_node_is_retired_never_handed_out():
    """A preemption notice on node b: its idle worker is not handed out (the job would only
    have to evacuate it) and a worker coming back from a job there is not kept."""
    ws = (idle(1, node="a"), idle(2, node="b", since=5.0))
    obs = PoolObservation(10.0, ws, returned=(Returned(3, CPU1, "b"),),
                          want=Want(CPU1, 2, free_bundles=1), draining=frozenset({"b"}))
    d = policy().decide(obs)
    assert d.hand_out == (1,)
    assert d.keep == ()
    assert d.retired() == {2: DRAINING, 3: DRAINING}
    # no notice: node b's workers serve as before (the most recently returned first)
    d = policy().decide(PoolObservation(10.0, ws, returned=(Returned(3, CPU1, "b"),),
                                        want=Want(CPU1, 2, free_bundles=1)))
    assert d.hand_out == (3, 2) and d.keep == (3,) and not d.retire
