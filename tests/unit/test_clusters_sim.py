"""clusters simulator: the live policies on hand-checkable traces, failure-trace files and
generators, the fixes of issue 16 point 8, and driven by the planner."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from clusters import (
    ElasticInPlace,
    FailureEvent,
    ModelProfile,
    Plan,
    PlanError,
    RestartAll,
    SimConfig,
    SimulationError,
    TraceError,
    daly_interval_s,
    example_path,
    llama3_trace,
    load_cluster,
    load_trace,
    plan_cache,
    save_trace,
    simulate,
    transformer_profile,
    young_interval_s,
)
from clusters.checkpoint_interval import checkpoint_sweep, format_checkpoint_sweep
from clusters.policy import InPlaceRecovery, RestartAllRecovery, Restore, ScalingPolicy
from clusters.sim_config import format_sim_table
from clusters.sim_policies import SimPolicy, TimeCosts
from clusters.survival import fatal_nodes
from clusters.topology import Cluster
from clusters.trace import LLAMA3_KINDS, failure_trace, job_mttf_s, poisson_trace


def _cluster(nodes: int = 4, per: int = 2):
    return load_cluster(
        {
            "name": "sim",
            "pools": [
                {"name": "p", "device": "A100-80GB", "nodes": nodes, "devices_per_node": per}
            ],
        }
    )


TINY = ModelProfile.uniform(n_params=1e6, n_blocks=4, flops_per_sample=1e9)
CFG = SimConfig(
    duration_s=1000.0,
    checkpoint_every=100,
    upload_s=0.0,
    restore_s=0.0,
    peer_restore_s=0.0,
    repair_s=100.0,
)
FIXED = RestartAll(detection_s=10.0, restart_s=20.0)
SHRINK = RestartAll(name="restart-shrink", detection_s=10.0, restart_s=20.0, shrink=True)
ELASTIC = ElasticInPlace(detection_s=1.0, replan_s=2.0, grow_s=2.0)


def _linear(cluster):
    """Perfect scaling: 1 s per step on all 8 devices."""
    return 8.0 / len(cluster.devices), None


def _dp(cluster, st=None):
    n = len(cluster.devices)
    return (8.0 / n if st is None else st), Plan(
        strategy="dp", world_size=n, shares=(1,) * n, devices=tuple(d.id for d in cluster.devices))


def _exact(r):
    """Every second not turned into a full-speed kept step is itemised."""
    full_step = r.duration_s / r.ideal_steps
    assert r.time_lost_s == pytest.approx(r.duration_s - r.steps * full_step)
    assert min(r.downtime_s, r.recompute_s, r.degraded_s, r.checkpoint_s) >= 0


# ------------------------------------------------------------------ policies on a hand trace


def test_policies_on_a_small_deterministic_trace():
    """One node of four dies at t=250.5 and is back at t=350.5 (steps: 1 s each at full size).

    restart-all at a fixed size (Ray Train num_workers=N, torchrun --nnodes=N): detected at
    260.5, waits for the node (350.5), restarts (20 s) from the step-200 checkpoint at 370.5:
    one rollback (50.5 steps), 120 s down, then 629.5 steps: 829.5.
    restart-all in its elastic mode: rollback 250.5 -> 200 and down 30 s; runs 70 s at 6/8
    speed (52.5 steps, to 252.5); the node's return restarts it again from the checkpoint (Ray
    Train resizes like it recovers): rollback to 200, down 20 s; then 629.5 steps: 829.5.
    elastic: state from peers at step 250 (the half step in flight is lost), down 3 s; 97 s at
    6/8 speed (72.75 steps); grows with a 2 s pause, losing nothing; then 647.5: 970.25.
    """
    fixed, shrink, el = simulate(
        _cluster(), TINY, 8, policies=(FIXED, SHRINK, ELASTIC), config=CFG,
        trace=[FailureEvent(250.5, "p-1")], evaluate=_linear,
    )
    assert (fixed.policy, shrink.policy, el.policy) == ("restart-all", "restart-shrink", "elastic")
    assert fixed.steps == pytest.approx(829.5)
    assert fixed.rollbacks == 1 and fixed.lost_steps == pytest.approx(50.5)
    assert fixed.downtime_s == pytest.approx(120.0) and fixed.degraded_s == 0
    assert shrink.steps == pytest.approx(829.5)
    assert shrink.rollbacks == 2 and shrink.lost_steps == pytest.approx(50.5 + 52.5)
    assert shrink.downtime_s == pytest.approx(50.0)
    assert el.steps == pytest.approx(970.25)
    assert el.rollbacks == 0 and el.lost_steps == pytest.approx(0.5)
    assert el.downtime_s == pytest.approx(5.0)
    for r in (fixed, shrink, el):
        assert r.failures == 1 and r.goodput == pytest.approx(r.steps / 1000.0)
        _exact(r)
    assert el.goodput > fixed.goodput
    table = format_sim_table([fixed, el])
    assert "restart-all" in table and f"{el.goodput:.1%}" in table


def test_restart_all_rolls_back_once_per_failure():
    """Issue 16: restart-all rolled back a second time when the repaired node rejoined (461
    rollbacks for 233 failures). At a fixed size the rejoin is the restart itself."""
    c = _cluster(nodes=8)
    cfg = replace(CFG, duration_s=30000.0, repair_s=600.0)  # back after the restart is done
    trace = [FailureEvent(500.5 + 2000 * i, f"p-{i % 8}") for i in range(12)]
    (rs,) = simulate(c, TINY, 16, policies=[RestartAll()], config=cfg, trace=trace,
                     evaluate=_linear)
    assert rs.failures == 12 and rs.rollbacks == 12
    _exact(rs)


def test_elastic_rolls_back_when_a_shard_has_no_replica():
    c = _cluster()
    ids = tuple(d.id for d in c.devices)

    def node_of(d):
        return c.device(d).node

    zero = Plan(strategy="zero2", world_size=8, shares=(1,) * 8, devices=ids)
    dp = Plan(strategy="dp", world_size=8, shares=(1,) * 8, devices=ids)
    assert "p-1" in fatal_nodes(zero, node_of)
    assert fatal_nodes(dp, node_of) == frozenset()
    # A pipeline whose stage 0 replicas both sit on node p-0 loses stage 0 with it.
    pipe = Plan(strategy="pipeline", world_size=8, shares=(4, 4), pp_degree=4, micro_batches=4,
                stage_split=(1, 1, 1, 1), devices=ids)
    assert "p-0" in fatal_nodes(pipe, node_of)
    spread = replace(pipe, devices=tuple(ids[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)))
    assert fatal_nodes(spread, node_of) == frozenset()
    # A node that holds no rank is never fatal, even under ZeRO.
    part = Plan(strategy="zero2", world_size=6, shares=(1,) * 6, devices=ids[:6])
    assert "p-3" not in fatal_nodes(part, node_of) and "p-2" in fatal_nodes(part, node_of)

    def with_zero(cluster):
        st, _ = _linear(cluster)
        n = len(cluster.devices)
        return st, Plan(strategy="zero2", world_size=n, shares=(1,) * n,
                        devices=tuple(d.id for d in cluster.devices))

    (el,) = simulate(c, TINY, 8, policies=[ELASTIC], config=CFG,
                     trace=[FailureEvent(250.5, "p-1")], evaluate=with_zero)
    assert el.rollbacks == 1 and el.lost_steps == pytest.approx(50.5)


def test_the_simulator_executes_the_policy_classes_decisions():
    """A SimPolicy is policy.py's classes plus time costs: swap the recovery and the same
    elastic system restores from the checkpoint."""
    assert isinstance(RestartAll().recovery, RestartAllRecovery)
    assert isinstance(ElasticInPlace().recovery, InPlaceRecovery)
    assert RestartAll().fixed_size and not RestartAll(shrink=True).fixed_size

    class FromCheckpoint(InPlaceRecovery):
        def decide(self, obs):
            return Restore("checkpoint", max(obs.checkpoints, default=0))

    odd = SimPolicy(name="odd", recovery=FromCheckpoint(), costs=TimeCosts(
        detection_s=1.0, replan_s=2.0, grow_s=2.0))
    (r,) = simulate(_cluster(), TINY, 8, policies=[odd], config=CFG,
                    trace=[FailureEvent(250.5, "p-1")], evaluate=_linear)
    assert r.rollbacks == 2 and r.lost_steps == pytest.approx(50.5 + 72.75)
    _exact(r)


def test_spares_and_process_kinds_follow_the_config():
    c = _cluster()
    cfg = replace(CFG, spare_nodes={"*": 1}, spare_start_s=40.0, process_restart_s=30.0)
    # A spare takes p-1's place at 290.5: the fixed-size job restarts at 310.5, not 370.5.
    (rs,) = simulate(c, TINY, 8, policies=[FIXED], config=cfg,
                     trace=[FailureEvent(250.5, "p-1")], evaluate=_linear)
    assert rs.downtime_s == pytest.approx(40.0 + 20.0) and rs.rollbacks == 1
    # A crashed process is back after process_restart_s; a hang is seen at the group timeout.
    (el,) = simulate(c, TINY, 8, policies=[ELASTIC], config=cfg,
                     trace=[FailureEvent(250.5, "p-1", kind="process_lost")], evaluate=_linear)
    assert el.downtime_s == pytest.approx(3.0 + 2.0)
    assert el.degraded_s == pytest.approx((280.5 - 253.5) * 0.25)
    (hung,) = simulate(c, TINY, 8, policies=[ELASTIC], config=cfg,
                       trace=[FailureEvent(250.5, "p-1", kind="hang")], evaluate=_linear)
    assert hung.downtime_s == pytest.approx(60.0 + 2.0)  # ElasticInPlace: 60 s hang timeout


def test_failure_budget_ends_the_job():
    (el,) = simulate(_cluster(), TINY, 8, policies=[ElasticInPlace(max_failures=1)],
                     config=CFG, evaluate=_linear,
                     trace=[FailureEvent(250.5, "p-1"), FailureEvent(500.5, "p-2")])
    assert el.failures == 2 and "max_failures=1" in el.ended
    assert el.downtime_s >= 1000.0 - 500.5
    _exact(el)
    assert "stopped early" in format_sim_table([el])


# ------------------------------------------------------------------ issue 16 point 8 fixes


def test_degraded_time_is_never_negative():
    """A plan on fewer devices predicted faster than the whole cluster's (the planner's 1 %
    tie tolerance, a ring over fewer ranks) made 'slow h' negative; it is charged at the whole
    cluster's speed."""

    def faster_when_smaller(cluster):
        return (1.0 if len(cluster.devices) == 8 else 0.97), None

    for pol in (SHRINK, ELASTIC):
        (r,) = simulate(_cluster(), TINY, 8, policies=[pol], config=CFG,
                        trace=[FailureEvent(250.5, "p-1")], evaluate=faster_when_smaller)
        assert r.degraded_s >= 0
        _exact(r)


def test_no_plan_fits_is_an_error_not_nan_goodput():
    huge = ModelProfile.uniform(n_params=1e12, n_blocks=4, flops_per_sample=1e9)
    with pytest.raises(PlanError, match=r"(?s)no plan fits the whole cluster.*needs"):
        simulate(_cluster(), huge, 8, config=CFG, trace=[])
    with pytest.raises(PlanError, match="no plan fits"):
        simulate(_cluster(), TINY, 8, config=CFG, trace=[],
                 evaluate=lambda c: (math.inf, None))


def test_a_degraded_cluster_without_a_plan_counts_as_down():
    def only_whole(cluster):
        return (1.0 if len(cluster.devices) == 8 else math.inf), None

    (r,) = simulate(_cluster(), TINY, 8, policies=[SHRINK], config=CFG,
                    trace=[FailureEvent(250.5, "p-1")], evaluate=only_whole)
    assert not math.isnan(r.goodput) and r.degraded_s == 0
    assert r.downtime_s == pytest.approx(350.5 - 250.5 + 20.0)
    _exact(r)


def test_per_event_work_does_not_grow_with_the_cluster(monkeypatch):
    """The alive cluster is built once per pool composition, not per event (the cause of a
    simulated month at 10,000 GPUs taking 45-53 s)."""
    c = _cluster(nodes=1250, per=8)
    built = []
    orig = Cluster.without_nodes

    def counting(self, ids):
        built.append(1)
        return orig(self, ids)

    monkeypatch.setattr(Cluster, "without_nodes", counting)
    rng = random.Random(0)
    trace = sorted((FailureEvent(rng.uniform(0, 9e5), f"p-{rng.randrange(1250)}", 600.0)
                    for _ in range(400)), key=lambda e: e.time)
    calls = []

    def spy(cluster):
        calls.append(len(cluster.devices))
        return _dp(cluster, st=1.0)

    rs, el = simulate(c, TINY, 10000, config=replace(CFG, duration_s=1e6), trace=trace,
                      evaluate=spy)
    assert len(built) == len(calls) - 1 == len(set(calls)) - 1  # the whole cluster: no copy
    assert el.failures == rs.failures > 390 and el.rollbacks == 0


def test_a_trace_naming_an_unknown_node_is_an_error():
    with pytest.raises(TraceError, match=r"trace\[0\]: node 'p-9' is not in the cluster"):
        simulate(_cluster(), TINY, 8, config=CFG, trace=[FailureEvent(1.0, "p-9")],
                 evaluate=_linear)


# ------------------------------------------------------------------ traces


def test_failure_trace_is_seeded_and_follows_mtbf():
    c = _cluster(nodes=50)
    cfg = SimConfig(duration_s=100 * 86400.0, node_mtbf_s={"*": 10 * 86400.0}, repair_s=3600.0)
    a, b = failure_trace(c, cfg), failure_trace(c, cfg)
    assert a == b and a == sorted(a, key=lambda e: (e.time, e.node))
    assert 350 < len(a) < 650  # ~ 50 nodes x 100 days / 10 days
    other = failure_trace(
        c, SimConfig(duration_s=cfg.duration_s, node_mtbf_s=cfg.node_mtbf_s, seed=1)
    )
    assert other != a
    none = failure_trace(c, SimConfig(node_mtbf_s={"other-pool": 1.0}))
    assert none == []
    assert job_mttf_s(c, {"*": 10.0}) == pytest.approx(10.0 / 50)


def test_llama3_trace_has_its_interruption_rate():
    """419 unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes of 8)."""
    c = _cluster(nodes=2048, per=8)
    days = 54 * 86400.0
    t = llama3_trace(c, days, seed=1)
    assert 419 * 0.85 < len(t) < 419 * 1.15
    hw = sum(e.kind == "node_lost" for e in t) / len(t)
    assert abs(hw - LLAMA3_KINDS["node_lost"]) < 0.08
    assert {e.kind for e in t} <= {"node_lost", "process_lost", "hang"}
    fast = llama3_trace(c, days, seed=1, job_mttf_h=1.8)
    assert 720 * 0.85 < len(fast) < 720 * 1.15  # 54 days / 1.8 h
    assert llama3_trace(c, days, seed=1) == t


@pytest.mark.parametrize("ext", ["csv", "jsonl"])
def test_trace_files_round_trip(tmp_path, ext):
    c = _cluster(nodes=20)
    events = poisson_trace(c, 30 * 86400.0, {"*": 5 * 86400.0}, seed=2, kinds=LLAMA3_KINDS)
    events[0] = replace(events[0], repair_s=123.0)
    path = tmp_path / f"t.{ext}"
    save_trace(events, path)
    assert load_trace(path, c) == events


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("time,node,kind\n5,p-1,node_lost\nx,p-1,hang\n", ":3", "time must be a number"),
        ("time,node,kind\n5,p-7,node_lost\n", ":2", "node 'p-7' is not in the cluster"),
        ("time,node,kind\n5,p-1,node_lots\n", ":2", "did you mean 'node_lost'"),
        ("time,node,knd\n5,p-1,node_lost\n", ":2", "did you mean 'kind'"),
        ("time,node\n-1,p-1\n", ":2", "time must be a finite number of seconds >= 0"),
        ("time,node,repair_s\n1,p-1,0\n", ":2", "repair_s must be"),
        ("node,when\np-1,3\n", ":1", "does not name the columns"),
        ("# only a comment\n", "", "is empty"),
    ],
)
def test_trace_file_errors_name_the_line_and_the_fix(tmp_path, text, where, problem):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        load_trace(path, _cluster())
    assert f"bad.csv{where}" in str(e.value) and problem in str(e.value)


def test_jsonl_trace_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"time": 1, "node": "p-1"}) + "\n\n{not json\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:3: is not JSON"):
        load_trace(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(TraceError, match="must be a JSON object"):
        load_trace(path)
    with pytest.raises(TraceError, match="name the file"):
        load_trace(tmp_path / "trace.txt")


def test_sim_config_errors_name_the_setting():
    with pytest.raises(SimulationError, match="checkpoint_every"):
        SimConfig(checkpoint_every=0)
    with pytest.raises(SimulationError, match="duration_s"):
        SimConfig(duration_s=-1.0)


# ------------------------------------------------------------------ checkpoint interval


def test_young_daly_next_to_the_swept_optimum():
    assert young_interval_s(60.0, 10800.0) == pytest.approx(math.sqrt(2 * 60 * 10800))
    d = daly_interval_s(60.0, 10800.0)
    assert young_interval_s(60.0, 10800.0) - 60 < d < young_interval_s(60.0, 10800.0) * 1.05
    assert daly_interval_s(500.0, 100.0) == 100.0
    with pytest.raises(ValueError):
        young_interval_s(1.0, 0.0)
    # A restart-all job with a blocking 20 s checkpoint and a 2000 s MTTF: Young says ~283
    # steps of 1 s; the sweep's optimum lands near it.
    c = _cluster(nodes=8)
    cfg = replace(CFG, duration_s=1e6, checkpoint_stall_s=20.0, repair_s=30.0)
    trace = poisson_trace(c, cfg.duration_s, {"*": 16000.0}, seed=4, repair_s=30.0)
    mttf = cfg.duration_s / len(trace)
    plans = plan_cache(c, TINY, 16, evaluate=lambda cl: (16.0 / len(cl.devices), None))
    pol = RestartAll(detection_s=10.0, restart_s=20.0)
    rows = checkpoint_sweep(c, TINY, 16, [50, 100, 200, 300, 450, 700, 1200], policy=pol,
                            config=cfg, trace=trace, plans=plans)
    best = max(rows, key=lambda kr: kr[1].goodput)[0]
    y = young_interval_s(20.0, mttf)
    assert y / 2 <= best <= y * 2
    planned = plans.calls  # each composition once, for all 7 runs
    checkpoint_sweep(c, TINY, 16, [best], policy=pol, config=cfg, trace=trace, plans=plans)
    assert plans.calls == planned <= 4
    text = format_checkpoint_sweep(rows, 1.0, 20.0, mttf)
    assert "best swept" in text and "Young" in text and "Daly" in text


# ------------------------------------------------------------------ with the planner


def test_simulator_driven_by_the_planner_on_a_larger_cluster():
    c = _cluster(nodes=32, per=8)  # 256 A100s
    prof = transformer_profile(layers=8, d_model=1024, n_heads=16, seq_len=512, vocab=32000)
    cfg = SimConfig(
        duration_s=2 * 86400.0, checkpoint_every=200, node_mtbf_s={"*": 5 * 86400.0}, seed=3
    )
    rs, el = simulate(c, prof, 512, config=cfg, strategies=("dp", "zero1"))
    assert rs.failures == el.failures > 0
    assert el.goodput > rs.goodput
    assert el.downtime_s < rs.downtime_s
    for r in (rs, el):
        full = cfg.duration_s / r.ideal_steps
        assert r.time_lost_s == pytest.approx(cfg.duration_s - r.steps * full, rel=1e-6)
        assert r.degraded_s >= 0


def test_cached_plans_follow_the_nodes_actually_alive():
    """Two failures of different nodes give the same pool composition; the second reuses the
    first's plan, its nodes taken by position among the alive nodes of the pool."""
    c = _cluster(nodes=4, per=2)
    trace = [FailureEvent(100.0, "p-1", repair_s=50.0), FailureEvent(400.0, "p-2", repair_s=50.0)]
    seen = []

    def spy(cluster):
        seen.append(cluster)
        return _dp(cluster)

    (el,) = simulate(c, TINY, 8, policies=[ELASTIC], config=CFG, trace=trace, evaluate=spy)
    assert len(seen) == 2  # the whole cluster, and "one node down" computed once
    assert el.failures == 2 and el.rollbacks == 0

    def stage0_on_first_node(cluster):
        d = [x.id for x in cluster.devices]  # 3 nodes of 2: stage 0 on the first node only
        ids = (d[0], d[1], d[2], d[4], d[3], d[5])
        return 1.0, Plan(strategy="pipeline", world_size=6, shares=(2, 2), pp_degree=3,
                         micro_batches=2, stage_split=(1, 1, 2), devices=ids)

    plans = plan_cache(c, TINY, 8, evaluate=stage0_on_first_node)
    first = plans.entry({"p-0"})  # alive p-1, p-2, p-3: p-1 holds all of stage 0
    assert first.fatal == {"p": frozenset({0})}
    same = plans.entry({"p-3"})  # alive p-0, p-1, p-2: the same plan, mapped by position
    assert same is first
    assert not plans.survives(same, {"p-3"}, "p-0") and plans.survives(same, {"p-3"}, "p-1")


def test_rejoin_during_recovery_rides_along():
    """The node comes back while the fixed-size job is still restarting: no second cost."""
    (rs,) = simulate(_cluster(), TINY, 8, policies=[FIXED], config=CFG, evaluate=_linear,
                     trace=[FailureEvent(250.5, "p-1", repair_s=5.0)])
    assert rs.rollbacks == 1 and rs.downtime_s == pytest.approx(10.0 + 20.0)


def test_scaling_policy_gives_up_below_min_workers():
    one = _cluster(nodes=1)
    pol = SimPolicy(name="tiny", recovery=InPlaceRecovery(),
                    scaling=ScalingPolicy(min_workers_timeout_s=30.0))
    (r,) = simulate(one, TINY, 2, policies=[pol], config=CFG, evaluate=lambda c: (1.0, None),
                    trace=[FailureEvent(100.0, "p-0")])
    assert "fewer than min_workers" in r.ended
    _exact(r)


def test_a_whole_cluster_outage_is_downtime_until_the_nodes_are_back():
    """Every node lost at once (found by a new user, session 47): restart-all is down until
    the nodes are repaired, then goes on from its last checkpoint; elastic's scaling policy
    gives up below min_workers after its timeout, saying so (the live job's rule). Was: the
    planner asked to plan zero devices raised, for every policy."""
    cl = load_cluster({"name": "s4", "pools": [{"name": "a", "device": "A100-80GB",
                                                "nodes": 4, "devices_per_node": 8,
                                                "network": "ib-hdr", "nics": 8}]})
    prof = transformer_profile(layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab=50257)
    cfg = SimConfig(duration_s=86400.0)
    trace = [FailureEvent(3601.3, f"a-{i}") for i in range(4)]
    by = {r.policy: r for r in simulate(cl, prof, 256, config=cfg, trace=trace)}
    r = by["restart-all"]
    assert r.failures == 4 and r.rollbacks == 1 and not r.ended, r
    assert cfg.repair_s <= r.downtime_s < cfg.repair_s + 600, r  # the repair, a restart
    assert r.steps > 0.9 * r.ideal_steps, r
    assert "fewer than min_workers" in by["elastic"].ended


def test_pool_keyed_settings_must_name_a_pool_of_the_cluster():
    """A typo in a pool name (``"A"`` for pool ``a``) is refused naming the key and the
    pools, as is a non-positive MTBF (found by a new user, session 47). Was: no failures and
    100 % goodput, spares ignored, or an error about a trace the user never wrote."""
    cl = load_cluster({"name": "s", "pools": [{"name": "a", "device": "A100-80GB", "nodes": 2,
                                               "devices_per_node": 8}]})
    prof = ModelProfile(block_params=(1000, 1000), block_flops=(1e9, 1e9))
    for bad in ({"node_mtbf_s": {"A": 3600.0}}, {"spare_nodes": {"gpu": 2}},
                {"preemption_per_h": {"spot": 0.1}}):
        with pytest.raises(SimulationError, match=r"names pool .*Fix: use one of 'a' or '\*'"):
            simulate(cl, prof, 64, config=SimConfig(duration_s=3600.0, **bad))
    with pytest.raises(SimulationError, match="node_mtbf_s must be"):
        SimConfig(node_mtbf_s={"a": -5.0})
    for never in (0.0, math.inf):  # what the message offers: no failure of that pool
        (r,) = simulate(cl, prof, 64, policies=[RestartAll()],
                        config=SimConfig(duration_s=3600.0, node_mtbf_s={"a": never}))
        assert r.failures == 0


def test_losing_a_node_the_plan_leaves_out_is_no_failure_of_the_job():
    """The plan runs on the A100 node alone: a T4 node's loss (or its process's) costs the
    job nothing, and its return is no join (found by a new user, session 47). Was: counted
    as a failure, restart-all rolled back and was down ~1 h."""
    cl = load_cluster(example_path("a100-t4"))
    prof = transformer_profile(layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab=50257)
    plans = plan_cache(cl, prof, 512)
    on = {cl.device(d).node for d in plans.entry(frozenset()).plan.devices}
    assert on == {"a100-0"}  # (the case: the T4 nodes idle)
    for kind in ("node_lost", "process_lost"):
        for r in simulate(cl, prof, 512, plans=plans, trace=[FailureEvent(3601.3, "t4-0",
                                                                         kind=kind)],
                          config=SimConfig(duration_s=86400.0, checkpoint_every=100)):
            assert (r.failures, r.rollbacks, r.downtime_s) == (0, 0, 0.0), r
            assert r.steps == pytest.approx(r.ideal_steps), r
    for r in simulate(cl, prof, 512, plans=plans, trace=[FailureEvent(3601.3, "a100-0")],
                      config=SimConfig(duration_s=86400.0, checkpoint_every=100)):
        assert r.failures == 1, r  # the node it runs on: a failure as before
