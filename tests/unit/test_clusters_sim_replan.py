"""The closed loop in the simulator (issue 16 point 5): ``clusters.sim_replan`` runs the live
``ReplanPolicy`` on ``clusters.refit.observe``'s observations, step by step, without Ray."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clusters import CostModel, ModelProfile, Plan, load_cluster
from clusters.policy import ReplanPolicy
from clusters.sim_replan import simulate_loop

# a model of many small tensors with a dear optimizer: ZeRO's sharded update looks cheapest
# when the profile timed the owners' broadcasts cheap, and is not when they are dear
PROFILE = ModelProfile(block_params=(4000,) * 12, bytes_per_param=4, optimizer_bytes_per_param=8,
                       precision="fp32", block_tensors=tuple((1000,) * 4 for _ in range(12)),
                       boundary_bytes=(1024.0,) * 12)


def _cluster(n=2):
    c = load_cluster({"name": "sim", "pools": [
        {"name": f"rank{i}", "nodes": 1, "devices_per_node": 1, "network": "loopback",
         "device": "CPU"} for i in range(n)]})
    return c, [d.id for d in c.devices]


def _model(ids, opt=(1e-6, 1e-9, 1e-6), **alphas):
    coll = {"all_reduce": (1e-4, 0.0), "reduce": (1e-4, 0.0), "broadcast": (1e-4, 0.0),
            "all_gather": (1e-4, 0.0), "reduce_scatter": (1e-4, 0.0), "p2p": (2e-2, 0.0)}
    coll.update({k: (v, 0.0) for k, v in alphas.items()})
    return CostModel(seconds_per_sample=dict.fromkeys(ids, 1e-4), collectives=coll,
                     optimizer_fit=dict.fromkeys(ids, opt),
                     pass_overhead_s=0.0, step_overhead=1e-3)


def test_the_loop_leaves_a_plan_that_measures_slower_than_predicted():
    cluster, ids = _cluster()
    opt = (1e-6, 1e-7, 1e-6)  # 4.8 ms for the whole update, half of it per ZeRO owner
    profiled = _model(ids, opt, all_reduce=3e-3, reduce=1e-5, broadcast=1e-5, all_gather=5e-3,
                      reduce_scatter=5e-3)
    truth = _model(ids, opt, all_reduce=3e-3, reduce=1e-2, broadcast=1e-2, all_gather=5e-3,
                   reduce_scatter=5e-3)
    res = simulate_loop(cluster, PROFILE, 64, truth=truth, profiled=profiled, steps=2000,
                        replan_every=50, switch_s=1.0)
    assert res.start.strategy in ("zero1", "zero2")  # what the profile made look cheapest
    first = res.changes[0]
    assert first.decision == "SwitchPlan" and first.step == 52 and "> switch" in first.reason
    assert res.final.strategy not in ("zero1", "zero2")
    assert res.seconds < 0.95 * res.static_s  # the loop paid for itself
    # no switching back and forth: once on the faster plan, every decision keeps it
    assert all(e.decision == "KeepPlan" for e in res.events if e.step > res.changes[-1].step)


def test_a_straggler_is_named_and_its_share_re_cut():
    cluster, ids = _cluster()
    m = _model(ids)
    res = simulate_loop(cluster, PROFILE, 64, truth=m, profiled=m, steps=1500, replan_every=50,
                        slowdowns={300: {ids[1]: 3.0}})
    recut = [e for e in res.changes if e.decision == "RecutShares"]
    assert recut and 300 < recut[0].step <= 410
    assert "rank 1 slower than its peers" in recut[0].reason
    assert res.final.shares[1] < res.final.shares[0] and sum(res.final.shares) == 64
    assert res.seconds < res.static_s


def test_the_loop_keeps_a_plan_when_nothing_pays():
    cluster, ids = _cluster()
    m = _model(ids)
    res = simulate_loop(cluster, PROFILE, 64, truth=m, profiled=m, steps=600, replan_every=50,
                        noise=0.05)
    assert res.events and not res.changes and res.final == res.start
    assert res.seconds == pytest.approx(res.static_s, rel=0.02)
    # a switch that would pay over many steps does not pay at the end of a job
    short = simulate_loop(cluster, PROFILE, 64, truth=replace(m, step_overhead=2e-3),
                          profiled=m, steps=60, replan_every=50, switch_s=100.0)
    assert not short.changes


def test_the_policy_is_the_live_one_and_a_stricter_one_waits():
    cluster, ids = _cluster()
    profiled = _model(ids, all_reduce=3e-3, reduce=1e-5, broadcast=1e-5)
    truth = _model(ids, all_reduce=3e-3, reduce=2e-3, broadcast=2e-3)
    strict = simulate_loop(cluster, PROFILE, 64, truth=truth, profiled=profiled, steps=400,
                           policy=ReplanPolicy(margin=1e6))
    assert not strict.changes and isinstance(strict.start, Plan)
