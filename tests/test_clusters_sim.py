"""clusters simulator: failure policies on a hand-checkable trace, and driven by the planner."""

from __future__ import annotations

import pytest

from clusters import (
    ElasticInPlace,
    FailureEvent,
    ModelProfile,
    Plan,
    RestartAll,
    SimConfig,
    load_cluster,
    simulate,
    transformer_profile,
)
from clusters.simulator import _remap, _replicas_survive, failure_trace, format_sim_table


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
POLICIES = (
    RestartAll(detection_s=10.0, restart_s=20.0),
    ElasticInPlace(detection_s=1.0, replan_s=2.0, grow_s=2.0),
)


def _linear(cluster):
    """Perfect scaling: 1 s per step on all 8 devices."""
    return 8.0 / len(cluster.devices), None


def test_policies_on_a_small_deterministic_trace():
    """One node of four dies at t=250.5 and is back at t=350.5 (steps: 1 s each at full size).

    restart-all: rollback 250.5 -> 200 and down 30 s; runs 70 s at 6/8 speed (52.5 steps, to
    252.5); the node's return restarts again: rollback to 200, down 20 s; then 629.5 steps at
    full speed: 829.5. elastic: no rollback, down 3 s; 97 s at 6/8 speed (72.75 steps); grows
    with a 2 s pause; then 647.5 steps: 970.75.
    """
    rs, el = simulate(
        _cluster(),
        TINY,
        8,
        policies=POLICIES,
        config=CFG,
        trace=[FailureEvent(250.5, "p-1")],
        evaluate=_linear,
    )
    assert rs.policy == "restart-all" and el.policy == "elastic"
    assert rs.steps == pytest.approx(829.5)
    assert rs.rollbacks == 2 and rs.lost_steps == pytest.approx(50.5 + 52.5)
    assert rs.downtime_s == pytest.approx(50.0)
    assert el.steps == pytest.approx(970.75)
    assert el.rollbacks == 0 and el.lost_steps == 0 and el.downtime_s == pytest.approx(5.0)
    assert el.failures == rs.failures == 1
    for r in (rs, el):
        assert r.goodput == pytest.approx(r.steps / 1000.0)
        # Exact accounting: every second not turned into a full-speed kept step is itemised.
        assert r.time_lost_s == pytest.approx(1000.0 - r.steps * 1.0)
    assert el.goodput > rs.goodput
    table = format_sim_table([rs, el])
    assert "restart-all" in table and "97.1%" in table and "83.0%" in table


def test_elastic_rolls_back_when_a_shard_has_no_replica():
    c = _cluster()
    ids = tuple(d.id for d in c.devices)
    zero = Plan(strategy="zero2", world_size=8, shares=(1,) * 8, devices=ids)
    dp = Plan(strategy="dp", world_size=8, shares=(1,) * 8, devices=ids)
    assert not _replicas_survive(zero, c, "p-1")
    assert _replicas_survive(dp, c, "p-1")
    # A pipeline whose stage 0 replicas all sit on node p-0 loses stage 0 with it.
    pipe = Plan(
        strategy="pipeline",
        world_size=8,
        shares=(4, 4),
        pp_degree=4,
        micro_batches=4,
        stage_split=(1, 1, 1, 1),
        devices=ids,
    )
    assert not _replicas_survive(pipe, c, "p-0")
    spread = Plan(
        strategy="pipeline",
        world_size=8,
        shares=(4, 4),
        pp_degree=4,
        micro_batches=4,
        stage_split=(1, 1, 1, 1),
        devices=tuple(ids[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)),
    )
    assert _replicas_survive(spread, c, "p-0")

    def with_zero(cluster):
        st, _ = _linear(cluster)
        n = len(cluster.devices)
        return st, Plan(
            strategy="zero2",
            world_size=n,
            shares=(1,) * n,
            devices=tuple(d.id for d in cluster.devices),
        )

    (el,) = simulate(
        c,
        TINY,
        8,
        policies=POLICIES[1:],
        config=CFG,
        trace=[FailureEvent(250.5, "p-1")],
        evaluate=with_zero,
    )
    assert el.rollbacks == 1 and el.lost_steps == pytest.approx(50.5)


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


def test_cached_plans_follow_the_nodes_actually_alive():
    """Two failures of different nodes give the same pool composition; the second reuses the
    first's plan, moved onto the devices alive then (dp: replicas survive, no rollback)."""
    c = _cluster(nodes=4, per=2)
    trace = [FailureEvent(100.0, "p-1", repair_s=50.0), FailureEvent(400.0, "p-2", repair_s=50.0)]
    seen = []

    def spy(cluster):
        st, _ = _linear(cluster)
        n = len(cluster.devices)
        seen.append(cluster)
        return st, Plan(
            strategy="dp",
            world_size=n,
            shares=(1,) * n,
            devices=tuple(d.id for d in cluster.devices),
        )

    (el,) = simulate(c, TINY, 8, policies=POLICIES[1:], config=CFG, trace=trace, evaluate=spy)
    assert len(seen) == 2  # full cluster, and "one node down" computed once
    assert el.failures == 2 and el.rollbacks == 0
    a, b = c.without_nodes({"p-1"}), c.without_nodes({"p-2"})
    pa = Plan(strategy="dp", world_size=6, shares=(1,) * 6, devices=tuple(d.id for d in a.devices))
    pb = _remap(pa, a, b)
    assert pb.devices == tuple(d.id for d in b.devices) and "p-1/0" in pb.devices
