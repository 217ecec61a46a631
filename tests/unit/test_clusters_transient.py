"""Transient servers in clusters/: spot pools and prices, preemption traces with notices, the
simulated systems that act on a notice (evacuation, checkpoint then recover), the bill, and
the plan table's price column. Hand-checked small cases; no Ray, no torch."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from clusters import (
    ClusterFileError,
    ElasticInPlace,
    FailureEvent,
    InventoryError,
    ModelProfile,
    Plan,
    PlanError,
    RestartAll,
    SimConfig,
    SimulationError,
    TraceError,
    cluster_from_ray_nodes,
    cluster_to_dict,
    device_type,
    device_types,
    failure_trace,
    load_cluster,
    load_trace,
    plan_cache,
    plan_main,
    preemption_trace,
    save_trace,
    simulate,
    transformer_profile,
)
from clusters.policy import EvacuationPolicy
from clusters.prices import (
    cluster_cost_per_hour,
    cost_per_1k_steps,
    parse_prices,
    plan_cost_per_hour,
    with_prices,
)
from clusters.sim_config import format_sim_table
from clusters.sim_plans import PlanCache

# ------------------------------------------------------------------ a small mixed cluster


def _mixed(od_price: float | None = 2.0, spot_price: float | None = 1.0, device="A100-80GB"):
    """2 on-demand + 2 spot nodes of 2 devices: $12 per hour at the default prices."""
    pools = []
    for name, market, price in (("od", "on_demand", od_price), ("spot", "spot", spot_price)):
        p = {"name": name, "device": device, "nodes": 2, "devices_per_node": 2,
             "market": market}
        if price is not None:
            p["price_per_device_hour"] = price
        pools.append(p)
    return load_cluster({"name": "mixed", "pools": pools})


# A state of a few bytes: an evacuation's move costs nothing beyond its live switch.
TINY = ModelProfile.uniform(n_params=1, n_blocks=4, flops_per_sample=1e9)
CFG = SimConfig(duration_s=1000.0, checkpoint_every=100, upload_s=0.0, restore_s=0.0,
                peer_restore_s=0.0, repair_s=100.0, preemption_return_s=100.0)
NOTICE = [FailureEvent(250.5, "spot-1", kind="notice"),
          FailureEvent(370.5, "spot-1", kind="preempted")]
FULL_COST = 12.0 * 1000 / 3600  # 4 devices at $2 and 4 at $1 per hour, for 1000 s


def _linear(cluster):
    """1 s per step on all 8 devices, perfect scaling; dp (every node's loss survivable)."""
    return 8.0 / len(cluster.devices), None


def _zero(cluster):
    """The same speed under zero2: no survivor holds a lost node's shard."""
    n = len(cluster.devices)
    return 8.0 / n, Plan(strategy="zero2", world_size=n, shares=(1,) * n,
                         devices=tuple(d.id for d in cluster.devices))


def _sim(policy, trace=NOTICE, evaluate=_zero, config=CFG, cluster=None):
    (r,) = simulate(cluster or _mixed(), TINY, 8, policies=[policy], config=config,
                    trace=trace, evaluate=evaluate)
    full = r.duration_s / r.ideal_steps
    assert r.time_lost_s == pytest.approx(r.duration_s - r.steps * full)
    return r


EVAC = ElasticInPlace(name="evacuate", detection_s=1.0, replan_s=2.0, grow_s=2.0,
                      peer_copy_every=50, evacuation=EvacuationPolicy())
FROM_CKPT = ElasticInPlace(name="in-place-ckpt", detection_s=1.0, replan_s=2.0, grow_s=2.0)
FROM_PEERS = replace(FROM_CKPT, name="in-place-peers", peer_copy_every=50)
FIXED = RestartAll(detection_s=10.0, restart_s=20.0)
RAY_V2 = RestartAll(name="restart-ckpt-notice", detection_s=10.0, restart_s=20.0,
                    checkpoint_on_notice=True)


# ------------------------------------------------------------------ the systems, by hand


def test_evacuation_on_notice_loses_no_step():
    """Notice at 250.5 (deadline 370.5): at the step boundary (251) the node's state moves to
    the survivors, a 2 s pause; 6/8 speed until its capacity is back (deadline + 100 s =
    470.5: 163.125 steps), a 2 s join; then 527.5 steps: 941.625, nothing lost. The node is
    not billed from 251 to 470.5 (2 devices at $1)."""
    r = _sim(EVAC)
    assert r.steps == pytest.approx(941.625)
    assert r.lost_steps == 0 and r.rollbacks == 0 and r.failures == 0
    assert (r.preemptions, r.evacuations) == (1, 1)
    assert r.downtime_s == pytest.approx(4.0)
    assert r.degraded_s == pytest.approx((470.5 - 253.0) * 0.25)
    assert r.cost_usd == pytest.approx(FULL_COST - 2 * 1.0 * (470.5 - 251.0) / 3600)
    assert r.cost_per_1k_steps == pytest.approx(r.cost_usd / r.steps * 1000)


def test_in_place_from_checkpoint_and_from_peers_ignore_the_notice():
    """The node goes at 370.5 (step 370.5). From the checkpoint at 300: 70.5 steps lost,
    down 3 s, 97 s at 6/8 (72.75 steps), a 2 s join, 527.5 steps: 900.25. From a buddy's
    copy at step 350 (every 50): 20.5 lost, 950.25. Both pay for the node until 370.5."""
    ck, peers = _sim(FROM_CKPT), _sim(FROM_PEERS)
    assert ck.steps == pytest.approx(900.25)
    assert ck.rollbacks == 1 and ck.lost_steps == pytest.approx(70.5)
    assert peers.steps == pytest.approx(950.25)
    assert peers.rollbacks == 0 and peers.lost_steps == pytest.approx(20.5)
    for r in (ck, peers):
        assert (r.failures, r.preemptions, r.evacuations) == (1, 1, 0)
        assert r.downtime_s == pytest.approx(5.0)
        assert r.cost_usd == pytest.approx(FULL_COST - 2 * 1.0 * 100.0 / 3600)
    # Under dp every survivor holds the state: no copy is needed, only the step in flight goes.
    dp = _sim(FROM_CKPT, evaluate=_linear)
    assert dp.lost_steps == pytest.approx(0.5) and dp.rollbacks == 0


def test_the_re_formed_group_takes_a_copy_at_its_first_boundary():
    """The first loss (step 320.5) restores the copy of step 300; the group re-forms there,
    and its first step boundary (301) takes a copy (the live ``PeerCopies`` after a reset).
    The second loss, 16.5 steps later, restores that copy: 15.5 lost, where the copies of
    the old ring (and the next multiple of 50, at 350) would have left only the checkpoint
    of step 300 (16.5 lost, a rollback)."""
    trace = [FailureEvent(320.5, "spot-0", kind="preempted"),
             FailureEvent(345.5, "spot-1", kind="preempted")]
    r = _sim(FROM_PEERS, trace=trace)
    assert r.failures == 2 and r.rollbacks == 0  # both from copies
    assert r.lost_steps == pytest.approx(20.5 + 15.5)


def test_a_peer_copy_older_than_the_last_membership_change_is_not_used():
    """Copies of the old ring are never used: with the group re-formed at step 300 and no
    step since, there is no copy; at 301 there is the re-formed group's own."""
    from clusters.sim_policies import JobView

    def at(position: int) -> int | None:
        return FROM_PEERS.buddy_step(JobView(position, (), 6, 8, 1, last_change=300))

    assert at(300) is None and at(301) == 301 and at(349) == 301 and at(350) == 350
    # none before step k (the live job takes its first copy after k steps; was: "step 0's",
    # a peer restore charged where the live job starts again from its seed)
    assert FROM_PEERS.buddy_step(JobView(49, (), 8, 8)) is None
    assert FROM_CKPT.buddy_step(JobView(349, (), 6, 8, 1, last_change=300)) is None


def test_restart_all_ignores_the_notice_or_checkpoints_on_it():
    """Fixed-size restart-all: lost at 370.5, waits for the capacity (470.5), restarts 20 s
    from step 300: 809.5. Ray Train V2's way (checkpoint on the notice, restart): released at
    251, no step lost, but the fixed-size group waits until 470.5 + 20 s: 760.5."""
    torch_run, ray_v2 = _sim(FIXED), _sim(RAY_V2)
    assert torch_run.steps == pytest.approx(809.5) and torch_run.rollbacks == 1
    assert torch_run.cost_usd == pytest.approx(FULL_COST - 2 * 100.0 / 3600)
    assert ray_v2.steps == pytest.approx(760.5)
    assert ray_v2.lost_steps == 0 and ray_v2.rollbacks == 0
    assert (ray_v2.failures, ray_v2.preemptions) == (1, 1)
    assert ray_v2.downtime_s == pytest.approx(490.5 - 251.0)
    assert ray_v2.cost_usd == pytest.approx(FULL_COST - 2 * (470.5 - 251.0) / 3600)


# 20 B parameters at 14 B each: 280 GB, 70 GB per node of 4, handed over at 12.5 GB/s (one
# 100 Gb/s NIC, the default network) in 5.6 s; the policy wants 2 x 5.6 s + 1 s of the time
# left at the step boundary.
BIG = ModelProfile.uniform(n_params=20_000_000_000, n_blocks=4, flops_per_sample=1e9)
MOVE_S = 70e9 / 12.5e9


def _notice(lead: float, at: float = 370.5) -> list[FailureEvent]:
    return [FailureEvent(at - lead, "spot-1", kind="notice"),
            FailureEvent(at, "spot-1", kind="preempted")]


def _big(policy, trace, upload_s=0.0, evaluate=_zero):
    (r,) = simulate(_mixed(), BIG, 8, policies=[policy], trace=trace, evaluate=evaluate,
                    config=replace(CFG, upload_s=upload_s))
    return r


def test_the_move_hands_over_the_nodes_share_then_switches():
    """Notice at 250.5, boundary 251, 119.5 s left: move. The node hands over 70 GB (5.6 s,
    billed until then), the survivors switch (2 s): down 7.6 s, then 6/8 speed until the
    capacity is back at 470.5, a 2 s join, 527.5 steps."""
    r = _big(EVAC, _notice(120.0))
    assert (r.evacuations, r.failures, r.lost_steps) == (1, 0, 0)
    assert r.downtime_s == pytest.approx(MOVE_S + 2.0 + 2.0)
    assert r.steps == pytest.approx(251 + (470.5 - 251 - MOVE_S - 2.0) * 0.75 + 527.5)
    assert r.cost_usd == pytest.approx(FULL_COST - 2 * (470.5 - 251.0 - MOVE_S) / 3600)
    # Under dp the survivors hold every piece: nothing to hand over, 2 s of notice is enough.
    dp = _big(EVAC, _notice(2.0), evaluate=_linear)
    assert (dp.evacuations, dp.failures, dp.lost_steps) == (1, 0, 0)
    assert dp.downtime_s == pytest.approx(2.0 + 2.0)


def test_a_notice_too_short_for_the_move_checkpoints_then_recovers():
    """8 s of notice: at the boundary (363) 7.5 s are left, 1 s kept: the move (2 x 5.6 s)
    does not fit, a 1 s checkpoint (2 x 1 s) does. The state is written at step 363 (the node
    billed until 364), the survivors recover from it (2 s re-plan): 0 steps lost."""
    r = _big(EVAC, _notice(8.0), upload_s=1.0)
    assert (r.evacuations, r.failures, r.preemptions) == (0, 1, 1)
    assert r.lost_steps == 0 and r.rollbacks == 0  # read back from storage, at step 363
    assert r.downtime_s == pytest.approx(1.0 + 2.0 + 2.0)
    assert r.steps == pytest.approx(363 + (470.5 - 366) * 0.75 + 527.5)
    assert r.cost_usd == pytest.approx(FULL_COST - 2 * (470.5 - 364.0) / 3600)


def test_a_notice_too_short_for_both_lets_the_node_go_and_restores_the_buddies_copies():
    """The same notice with a 5 s checkpoint: neither fits, the node is released at once
    (363) and the job restores the buddies' copies of step 350 (every 50 steps): 13 steps
    run again, no storage read. Without copies it is the checkpoint of step 300."""
    r = _big(EVAC, _notice(8.0), upload_s=5.0)
    assert (r.evacuations, r.failures, r.rollbacks) == (0, 1, 0)
    assert r.lost_steps == pytest.approx(13.0)
    assert r.steps == pytest.approx(350 + (470.5 - 365) * 0.75 + 527.5)
    no_copies = replace(EVAC, name="no-copies", peer_copy_every=0)
    ck = _big(no_copies, _notice(8.0), upload_s=5.0)
    assert ck.rollbacks == 1 and ck.lost_steps == pytest.approx(63.0)


@pytest.mark.parametrize(("lead", "margin", "path"),
                         [(120.0, 2.0, "move"), (30.0, 2.0, "move"), (12.0, 2.0, "checkpoint"),
                          (30.0, 10.0, "checkpoint")])
def test_the_live_evacuation_policy_decides(lead, margin, path):
    """The simulator asks ``clusters.policy.EvacuationPolicy`` itself: AWS's 2 minutes and
    GCP's 30 s leave room for a 5.6 s move twice over, 12 s does not (11.5 s left at the
    boundary, 1 s kept); a margin of 10 makes 30 s too short as well."""
    pol = replace(EVAC, evacuation=EvacuationPolicy(margin=margin))
    r = _big(pol, _notice(lead))
    assert (r.evacuations, r.failures) == ((1, 0) if path == "move" else (0, 1))
    assert r.lost_steps == 0


def test_survivors_that_cannot_hold_the_state_checkpoint_instead():
    def only_whole(cluster):
        return (1.0, None) if len(cluster.devices) == 8 else (math.inf, None)

    r = _sim(EVAC, evaluate=only_whole)
    assert r.evacuations == 0 and r.failures == 1 and r.lost_steps == 0
    assert r.downtime_s >= 470.5 - 251.0  # nothing fits until the node's capacity is back


def test_an_unannounced_preemption_is_a_loss_with_its_own_return_time():
    trace = [FailureEvent(250.5, "spot-0", kind="preempted", repair_s=50.0)]
    r = _sim(EVAC, trace=trace)
    assert (r.failures, r.preemptions, r.evacuations) == (1, 1, 0)
    assert r.lost_steps == pytest.approx(0.5)  # from the copy at step 250
    assert r.cost_usd == pytest.approx(FULL_COST - 2 * 50.0 / 3600)


# ------------------------------------------------------------------ the bill


def test_the_bill_counts_every_node_held_and_idle_spares():
    r = _sim(FROM_CKPT, trace=[])
    assert r.cost_usd == pytest.approx(FULL_COST)
    assert r.cost_per_1k_steps == pytest.approx(FULL_COST)  # 1000 steps
    spare = _sim(FROM_CKPT, trace=[], config=replace(CFG, spare_nodes={"spot": 1}))
    assert spare.cost_usd == pytest.approx(FULL_COST + 2 * 1.0 * 1000 / 3600)
    # A job that gave up holds nothing from then on.
    quit_ = _sim(ElasticInPlace(max_failures=0), trace=[FailureEvent(500.0, "od-0")])
    assert quit_.ended and quit_.cost_usd == pytest.approx(12.0 * 500 / 3600)


def test_no_price_means_no_cost():
    c = _mixed(od_price=None, device="H200")  # the catalog has no H200 price
    r = _sim(FROM_CKPT, trace=[], cluster=c)
    assert r.cost_usd is None and r.cost_per_1k_steps is None
    assert "-" in format_sim_table([r]).splitlines()[-1]


def test_time_to_a_fixed_number_of_steps():
    r = _sim(FROM_CKPT, trace=[], config=replace(CFG, target_steps=500))
    assert r.reached_target and r.duration_s == pytest.approx(500.0)
    assert r.steps == pytest.approx(500.0) and r.cost_usd == pytest.approx(12.0 * 500 / 3600)
    evac = _sim(EVAC, config=replace(CFG, target_steps=500))
    assert evac.reached_target and evac.duration_s == pytest.approx(500.0 + 4.0 + 54.375)
    short = _sim(FROM_CKPT, trace=[], config=replace(CFG, target_steps=5000))
    assert short.reached_target is False and short.duration_s == 1000.0
    assert _sim(FROM_CKPT, trace=[]).reached_target is None


def test_table_shows_preemptions_evacuations_and_cost():
    rows = [_sim(p) for p in (FIXED, RAY_V2, FROM_CKPT, FROM_PEERS, EVAC)]
    text = format_sim_table(rows)
    assert "evac" in text and "$/1k steps" in text and "restart-ckpt-notice" in text
    last = text.splitlines()[-1].split()
    assert last[0] == "evacuate" and last[-4:-2] == ["1", "1"]


def test_settings_that_cannot_be_simulated():
    with pytest.raises(SimulationError, match="preemption_per_h"):
        SimConfig(preemption_per_h={"spot": -1.0})
    with pytest.raises(SimulationError, match="target_steps"):
        SimConfig(target_steps=0)
    with pytest.raises(SimulationError, match="peer_copy_every"):
        ElasticInPlace(peer_copy_every=-5)


# ------------------------------------------------------------------ trace files


@pytest.mark.parametrize("ext", ["csv", "jsonl"])
def test_notice_traces_round_trip(tmp_path, ext):
    c = _mixed()
    events = preemption_trace(c, 40 * 3600.0, {"spot": 0.2}, notice_s=120.0, seed=3)
    events += [FailureEvent(10.0, "od-1", kind="process_lost"),
               FailureEvent(99.0, "spot-0", kind="preempted", repair_s=600.0)]
    events.sort(key=lambda e: (e.time, e.node, e.kind != "notice"))
    path = tmp_path / f"t.{ext}"
    save_trace(events, path)
    assert load_trace(path, c) == events


def test_a_notice_comes_before_a_loss_at_the_same_instant(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time,node,kind\n5,spot-1,preempted\n5,spot-1,notice\n")
    assert [e.kind for e in load_trace(path, _mixed())] == ["notice", "preempted"]


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("time,node,kind\n5,spot-1,notice\n", ":2", "has no 'preempted' event"),
        ("time,node,kind\n5,spot-1,notice\n6,spot-1,notice\n9,spot-1,preempted\n", ":3",
         "a second notice for node 'spot-1'"),
        ("time,node,kind,repair_s\n5,spot-1,notice,10\n9,spot-1,preempted,\n", ":2",
         "a notice has no repair_s"),
        ("time,node,kind\n5,spot-1,notise\n", ":2", "did you mean 'notice'"),
        ("time,node,kind\n5,spot-1,preemted\n", ":2", "did you mean 'preempted'"),
    ],
)
def test_notice_errors_name_the_line_and_the_fix(tmp_path, text, where, problem):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        load_trace(path, _mixed())
    assert f"bad.csv{where}" in str(e.value) and problem in str(e.value)
    assert "Fix:" in str(e.value)


def test_a_notice_without_its_loss_in_a_given_trace_is_an_error():
    with pytest.raises(TraceError, match=r"trace\[0\]: notice for node 'spot-1'"):
        _sim(EVAC, trace=[FailureEvent(5.0, "spot-1", kind="notice")])
    path_like = json.dumps({"time": 1, "node": "spot-1", "kind": "notice"})
    assert "notice" in path_like


# ------------------------------------------------------------------ the generator


def test_preemption_rates_and_notices_follow_the_settings():
    """200 spot nodes at 0.1 preemptions per node-hour for 1,000 h, each back after 30 min:
    1000 / (10 h + 0.5 h) = 95.2 per node; on-demand nodes are never preempted."""
    c = load_cluster({"name": "big", "pools": [
        {"name": "od", "device": "A100-80GB", "nodes": 10, "devices_per_node": 8},
        {"name": "spot", "device": "A100-80GB", "nodes": 200, "devices_per_node": 8,
         "market": "spot"}]})
    t = preemption_trace(c, 1000 * 3600.0, {"spot": 0.1}, notice_s={"spot": 30.0},
                         return_s=1800.0, seed=5)
    lost = [e for e in t if e.kind == "preempted"]
    notes = [e for e in t if e.kind == "notice"]
    assert 200 * 95.2 * 0.97 < len(lost) < 200 * 95.2 * 1.03
    assert len(notes) == len(lost) and {e.node.split("-")[0] for e in t} == {"spot"}
    first, leads = {}, []
    for e in t:  # each notice 30 s before its node's loss, or at its return if later
        if e.kind == "notice":
            first[e.node] = e.time
        else:
            leads.append(e.time - first.pop(e.node))
    assert max(leads) == pytest.approx(30.0) and min(leads) >= 0
    assert sum(abs(x - 30.0) < 1e-6 for x in leads) > 0.99 * len(leads)
    assert t == preemption_trace(c, 1000 * 3600.0, {"spot": 0.1}, notice_s={"spot": 30.0},
                                 return_s=1800.0, seed=5)
    quiet = preemption_trace(c, 100 * 3600.0, {"*": 0.1}, notice_s=0.0, seed=1)
    assert {e.kind for e in quiet} == {"preempted"}  # no notice: unannounced
    with pytest.raises(TraceError, match="rate"):
        preemption_trace(c, 10.0, {"spot": -1.0})
    with pytest.raises(TraceError, match="notice"):
        preemption_trace(c, 3600.0 * 100, {"spot": 1.0}, notice_s={"spot": math.nan})


def test_failure_trace_adds_preemptions_from_the_config():
    c = _mixed()
    cfg = SimConfig(duration_s=200 * 3600.0, node_mtbf_s={}, preemption_per_h={"spot": 0.5},
                    notice_s={"*": 30.0}, seed=2)
    t = failure_trace(c, cfg)
    assert t and {e.kind for e in t} == {"notice", "preempted"}
    assert all(e.node.startswith("spot-") for e in t)
    assert failure_trace(c, replace(cfg, preemption_per_h={})) == []


def test_a_generated_spot_trace_simulates_end_to_end():
    c = _mixed()
    cfg = replace(CFG, duration_s=50 * 3600.0, node_mtbf_s={}, preemption_per_h={"spot": 0.5})
    res = simulate(c, TINY, 8, policies=[FIXED, RAY_V2, FROM_CKPT, FROM_PEERS, EVAC],
                   config=cfg, evaluate=_zero)
    by = {r.policy: r for r in res}
    assert by["evacuate"].evacuations == by["evacuate"].preemptions > 10
    assert by["evacuate"].lost_steps == 0
    assert by["evacuate"].goodput > by["in-place-ckpt"].goodput
    assert by["in-place-peers"].goodput > by["in-place-ckpt"].goodput > by["restart-all"].goodput
    assert by["evacuate"].cost_per_1k_steps < by["restart-all"].cost_per_1k_steps


# ------------------------------------------------------------------ prices: catalog, files


def test_catalog_prices_say_where_they_come_from():
    priced = [d for d in device_types().values() if d.prices]
    assert {d.name for d in priced} >= {"A100-40GB", "A100-80GB", "H100", "T4", "L4"}
    for d in priced:
        assert 0 < d.prices["spot"] < d.prices["on_demand"]
        assert "AWS" in d.price_source and "2025" in d.price_source
    assert device_type("CPU").price_per_hour() is None


def test_pool_prices_default_to_the_catalog_for_their_market():
    c = _mixed(od_price=None, spot_price=None)
    a100 = device_type("A100-80GB")
    od, spot = c.pools
    assert od.device_price() == a100.prices["on_demand"]
    assert spot.device_price() == a100.prices["spot"]
    assert cluster_cost_per_hour(c) == pytest.approx(4 * a100.prices["on_demand"]
                                                     + 4 * a100.prices["spot"])
    given = _mixed()
    assert [p.device_price() for p in given.pools] == [2.0, 1.0]
    back = load_cluster(cluster_to_dict(given))
    assert [(p.market, p.device_price()) for p in back.pools] == [("on_demand", 2.0),
                                                                  ("spot", 1.0)]


@pytest.mark.parametrize(
    ("extra", "field", "problem"),
    [({"market": "spto"}, "pools[0].market", "did you mean 'spot'"),
     ({"price_per_device_hour": -1}, "pools[0].price_per_device_hour", "must be >= 0"),
     ({"price_per_device_hour": "cheap"}, "pools[0].price_per_device_hour", "a number"),
     ({"prize_per_device_hour": 1}, "pools[0].prize_per_device_hour", "did you mean")],
)
def test_cluster_file_price_errors(extra, field, problem):
    pool = {"name": "a", "device": "T4", "nodes": 1, "devices_per_node": 4, **extra}
    with pytest.raises(ClusterFileError) as e:
        load_cluster({"name": "x", "pools": [pool]})
    assert field in str(e.value) and problem in str(e.value)


def test_inventory_reads_the_market_label():
    def node(i, labels):
        return {"Alive": True, "NodeID": f"n{i}", "NodeManagerAddress": f"10.0.0.{i}",
                "Resources": {"GPU": 8.0, "accelerator_type:A100-80G": 1.0}, "Labels": labels}

    c = cluster_from_ray_nodes([node(0, {}), node(1, {"ray.io/market-type": "spot"}),
                                node(2, {"elastic.io/market": "on-demand"})])
    assert sorted((p.market, p.count) for p in c.pools) == [("on_demand", 2), ("spot", 1)]
    with pytest.raises(InventoryError, match="unknown market 'reserved'"):
        cluster_from_ray_nodes([node(0, {"elastic.io/market": "reserved"})])


# ------------------------------------------------------------------ prices: the plan table


def _row_costs(text: str) -> list[tuple[float, float]]:
    rows = [ln for ln in text.splitlines() if re.match(r"\s+\d+\s{2}\S", ln)]
    return [(float(r.split()[-2].replace(",", "")), float(r.split()[-1].replace(",", "")))
            for r in rows]


def test_the_plan_table_says_what_each_plan_costs():
    c = {"name": "one", "pools": [{"name": "a100", "device": "A100-80GB", "nodes": 1,
                                   "devices_per_node": 8, "price_per_device_hour": 2.0}]}
    prof = transformer_profile(layers=4, d_model=512, n_heads=8, seq_len=256, vocab=1000)
    text = plan_main(c, prof, 64, top=3)
    assert "$/h" in text and "$/1k steps" in text and "a100 $2 (on_demand, given)" in text
    steps = [float(ln.split()[-8]) for ln in text.splitlines() if re.match(r"\s+\d+\s{2}", ln)]
    for (per_h, per_k), st in zip(_row_costs(text), steps, strict=True):
        assert per_h == pytest.approx(16.0)  # 8 devices at $2
        assert per_k == pytest.approx(16.0 * st * 1000 / 3600, rel=2e-2, abs=6e-3)
    cheaper = plan_main(c, prof, 64, top=3, prices={"a100": 0.5})
    assert all(h == pytest.approx(4.0) for h, _ in _row_costs(cheaper))
    spot = plan_main(load_cluster(replace_market(c, "spot")), prof, 64, top=1)
    assert "(spot, given)" in spot


def replace_market(c, market):
    pools = [{**p, "market": market} for p in c["pools"]]
    return {**c, "pools": pools}


def test_a_plan_costs_only_the_devices_it_uses():
    c = load_cluster({"name": "two", "pools": [
        {"name": "a", "device": "A100-80GB", "nodes": 1, "devices_per_node": 2,
         "price_per_device_hour": 3.0},
        {"name": "t", "device": "T4", "nodes": 1, "devices_per_node": 2,
         "price_per_device_hour": 0.5}]})
    ids = tuple(d.id for d in c.devices)
    only_a = Plan(strategy="dp", world_size=2, shares=(1, 1), devices=ids[:2])
    every = Plan(strategy="dp", world_size=4, shares=(1,) * 4, devices=ids)
    assert plan_cost_per_hour(only_a, c) == pytest.approx(6.0)
    assert plan_cost_per_hour(every, c) == pytest.approx(7.0)
    assert cost_per_1k_steps(7.0, 3.6) == pytest.approx(7.0)
    none = load_cluster({"name": "h", "pools": [
        {"name": "h", "device": "H200", "nodes": 1, "devices_per_node": 2}]})
    hplan = Plan(strategy="dp", world_size=2, shares=(1, 1),
                 devices=tuple(d.id for d in none.devices))
    assert plan_cost_per_hour(hplan, none) is None
    text = plan_main(none, transformer_profile(layers=2, d_model=256, n_heads=4, seq_len=64,
                                               vocab=100), 8, top=1)
    assert "h - (on_demand, no price)" in text


def test_prices_option_forms_and_errors(tmp_path):
    assert parse_prices("a100=4.1, t4=0.39") == {"a100": 4.1, "t4": 0.39}
    f = tmp_path / "p.yaml"
    f.write_text("on_demand: 1.5\nA100-80GB: 4\n")
    c = with_prices(_mixed(od_price=None, spot_price=None), parse_prices(str(f)))
    assert [p.device_price() for p in c.pools] == [4.0, 4.0]  # device type beats market
    c = with_prices(_mixed(od_price=None, spot_price=None), {"on_demand": 1.5})
    assert [p.device_price() for p in c.pools] == [1.5, device_type("A100-80GB").prices[
        "spot"]]
    c = with_prices(_mixed(), {"spot": 0.25, "A100-80GB": 9})  # a pool's name beats both
    assert [p.device_price() for p in c.pools] == [9.0, 0.25]
    for bad in ("a100", "a100=x", ""):
        with pytest.raises(ClusterFileError, match="--prices"):
            parse_prices(bad)
    with pytest.raises(ClusterFileError, match="names no pool, device type or market"):
        with_prices(_mixed(), {"h100": 3.0})
    with pytest.raises(ClusterFileError, match=">= 0"):
        with_prices(_mixed(), {"spot": -2})


# ------------------------------------------------------------------ survivors' plans, speed


def test_keep_replans_the_whole_clusters_layout_family_on_the_survivors():
    """``replan="keep"``: the survivors run the whole cluster's strategy, dp mode and schedule
    (a pipeline no deeper), as the live controller re-plans; ``"best"`` asks for the best."""
    c = load_cluster({"name": "k", "pools": [
        {"name": "a", "device": "A100-80GB", "nodes": 4, "devices_per_node": 4}]})
    prof = transformer_profile(layers=8, d_model=1024, n_heads=16, seq_len=512, vocab=8000)
    keep = plan_cache(c, prof, 256, replan="keep")
    whole = keep.entry(frozenset()).plan
    assert whole is not None
    for dead in ({"a-0"}, {"a-0", "a-3"}):
        p = keep.entry(dead).plan
        assert p is not None and len(p.devices) == 16 - 4 * len(dead)
        assert (p.strategy, p.dp_mode, p.schedule) == (whole.strategy, whole.dp_mode,
                                                       whole.schedule)
        assert p.pp_degree <= whole.pp_degree
    best = plan_cache(c, prof, 256)
    assert best.entry({"a-0"}).step_time <= keep.entry({"a-0"}).step_time + 1e-12
    with pytest.raises(PlanError, match="replan must be 'best' or 'keep'"):
        plan_cache(c, prof, 256, replan="fastest")


def test_keep_replans_on_the_pools_the_job_runs_on():
    """A job planned on the A100s alone (the T4s would slow it) keeps to the A100s that
    survive under ``replan="keep"``, as a live job does (was: re-planned on every node, T4s
    too, with the subset search off), and to the planner's best once no A100 is left."""
    c = load_cluster({"name": "k", "pools": [
        {"name": "a", "device": "A100-80GB", "nodes": 3, "devices_per_node": 4},
        {"name": "t", "device": "T4", "nodes": 3, "devices_per_node": 4}]})
    prof = transformer_profile(layers=8, d_model=1024, n_heads=16, seq_len=512, vocab=8000)
    keep = plan_cache(c, prof, 240, replan="keep")
    whole = keep.entry(frozenset()).plan
    assert whole is not None and {c.device(d).pool for d in whole.devices} == {"a"}
    p = keep.entry({"a-0"}).plan
    assert p is not None and len(p.devices) == 8
    assert {c.device(d).pool for d in p.devices} == {"a"}
    assert keep.entry({"a-0", "a-1", "a-2"}).plan is not None  # the T4s, by the planner


def test_an_event_costs_o_pools_not_o_nodes_down(monkeypatch):
    """The pool counts and the current plan are kept with the nodes: the O(nodes down) lookup
    (``PlanCache.entry``) runs once, for the whole cluster, however many preemptions."""
    c = load_cluster({"name": "big", "pools": [
        {"name": "od", "device": "A100-80GB", "nodes": 20, "devices_per_node": 8},
        {"name": "spot", "device": "A100-80GB", "nodes": 200, "devices_per_node": 8,
         "market": "spot"}]})
    calls = []
    orig = PlanCache.entry

    def counting(self, dead):
        calls.append(len(dead))
        return orig(self, dead)

    monkeypatch.setattr(PlanCache, "entry", counting)
    cfg = SimConfig(duration_s=10 * 86400.0, preemption_per_h={"spot": 0.05}, seed=4)
    (r,) = simulate(c, TINY, 1760, policies=[EVAC], config=cfg, evaluate=_zero)
    assert r.preemptions > 2000 and r.evacuations > 0.99 * r.preemptions
    assert calls == [0, 0]  # simulate and the policy ask for the whole cluster


def test_a_notice_during_a_recovery_is_acted_on_when_the_job_runs_again():
    """An unannounced loss at 250.2 (the copy of step 250: 0.2 steps again, down 1 + 2 s to
    253.2); the notice at 251 waits for that boundary and the node's state moves then (a 2 s
    switch): nothing more lost."""
    trace = [FailureEvent(250.2, "od-0", kind="node_lost", repair_s=50.0),
             FailureEvent(251.0, "spot-1", kind="notice"),
             FailureEvent(370.5, "spot-1", kind="preempted")]
    r = _sim(EVAC, trace=trace)
    assert (r.failures, r.evacuations, r.preemptions) == (1, 1, 1)
    assert r.lost_steps == pytest.approx(0.2)
    assert r.downtime_s == pytest.approx(3.0 + 2.0 + 2.0 + 2.0)  # loss, move, two joins


def test_an_event_during_a_checkpoint_stall_leaves_the_rest_of_the_stall():
    """A blocking checkpoint stalls 50 s; an event in the middle of it (a notice the policy
    ignores, a repair) stops the clock there, and the rest of the stall is still spent.
    Was: the rest was dropped: an ignored notice at 110 s gave 100 steps more (700 against
    600) and 40 s less checkpointing, biasing the interval sweep toward short intervals."""
    c = _mixed()
    cfg = replace(CFG, checkpoint_stall_s=50.0)
    base = [FailureEvent(990.0, "spot-1", kind="preempted")]
    for policy in (RestartAll(), ElasticInPlace()):
        (a,) = simulate(c, TINY, 8, policies=[policy], config=cfg, trace=base, evaluate=_linear)
        (b,) = simulate(c, TINY, 8, policies=[policy], config=cfg,
                        trace=[FailureEvent(110.0, "spot-1", kind="notice"), *base],
                        evaluate=_linear)
        assert (b.steps, b.checkpoint_s) == (a.steps, a.checkpoint_s), (policy, a, b)


def test_a_crashed_process_leaves_its_machine_on_the_bill():
    """A ``process_lost`` (or ``hang``) restarts a process on a machine still there: it is
    billed while the process restarts. Was: taken off the bill like a lost node (7400
    against 8000 for 300 s of one node at $3600 a device-hour)."""
    c = load_cluster({"name": "b", "pools": [{"name": "p", "device": "A100-80GB", "nodes": 4,
                                              "devices_per_node": 2,
                                              "price_per_device_hour": 3600.0}]})
    cfg = replace(CFG, process_restart_s=300.0)
    (a,) = simulate(c, TINY, 8, policies=[ElasticInPlace()], config=cfg, trace=[],
                    evaluate=_linear)
    (b,) = simulate(c, TINY, 8, policies=[ElasticInPlace()], config=cfg,
                    trace=[FailureEvent(100.5, "p-1", kind="process_lost")], evaluate=_linear)
    (lost,) = simulate(c, TINY, 8, policies=[ElasticInPlace()], config=cfg,
                       trace=[FailureEvent(100.5, "p-1", kind="node_lost")], evaluate=_linear)
    assert b.cost_usd == pytest.approx(a.cost_usd) and lost.cost_usd < a.cost_usd
