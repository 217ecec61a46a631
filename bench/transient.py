"""Transient servers: spot + on-demand against on-demand only, per recovery system, simulated.

The kind of table of the transient-server study (Li, Walls, Xu, Guo 2019, "Speeding up Deep
Learning with Transient Servers", arXiv:1903.00045: "a speedup of 7.7X with more than 62.9 %
monetary savings for some cluster configurations" against on-demand servers), for a job of
today: a Llama-2-7B-like transformer (32 layers, d 4096, seq 2048, bf16, Adam) trained to
``--steps`` steps of ``--batch`` sequences on p4de-like nodes (8 x A100-80GB, 4 x EFA).

Clusters (``--od-nodes`` N, ``--mixed-od`` M):
* on-demand only: N on-demand nodes (the baseline);
* mixed, same size: M on-demand + N - M spot nodes;
* mixed, same budget: M on-demand + as many spot nodes as the on-demand ones saved pay for;
* spot only, same budget: as many spot nodes as N on-demand ones cost.

Systems (``clusters.sim_policies``, the live policies plus time costs): restart-all at a fixed
size (torchrun, Ray Train), restart-all that checkpoints on the notice (Ray Train V2), elastic
in place from the checkpoint, in place from peers (buddy copies every ``--peer-every`` steps:
``InPlaceRecovery``'s ``buddy_step``), and evacuation on notice (copies, and the live
controller's ``clusters.policy.EvacuationPolicy``: move, checkpoint then recover, or recover).

Assumptions, all options: preemptions per spot node-hour (``--rate``, default 0.01: Google
has said its preemptible VMs saw 5-15 % preempted per day, 0.002-0.006 per node-hour; GPU
spot capacity at scale is often scarcer, hence the sensitivity up to 0.2), the notice
(``--notice`` s: AWS 120, GCP and Azure 30), the time until a preempted node's capacity is
back (``--return-min``), prices (``clusters/catalog/devices.yaml``: AWS us-east-1 on-demand
list prices, spot assumed at 40 % of them; ``--spot-discount`` overrides), hardware failures
at the simulator's default (one per node per ~260 days), the time costs of
``RestartAll()`` / ``ElasticInPlace()`` (detection, 120 s restart, 10 s re-plan, 10 s
switch). Buddy copies cost no step time here (they are sent in the background; their host
memory is the live job's setting). ``--sensitivity`` varies each assumption for the
same-budget mixed cluster. Plans: the planner's, as the live controller re-plans for
survivors (the whole cluster's layout family where it fits, else the planner's best),
cached per pool composition. ``--at-scale`` times a simulated month on 10,000 GPUs instead.
A benchmark, not a test: it checks nothing. Run from the repository root:
``python bench/transient.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusters import (  # noqa: E402 - after the path set-up above
    Cluster,
    ElasticInPlace,
    Plan,
    PolicyResult,
    RestartAll,
    SimConfig,
    SimPolicy,
    cluster_cost_per_hour,
    device_type,
    failure_trace,
    format_sim_table,
    load_cluster,
    plan,
    plan_cache,
    simulate,
    transformer_profile,
)
from clusters.policy import EvacuationPolicy  # noqa: E402

HOUR = 3600.0
DEVICE = "A100-80GB"


def systems(peer_every: int) -> list[SimPolicy]:
    """The five systems compared: notices ignored (restart-all, in place from a checkpoint,
    in place from buddies' copies), Ray Train V2's checkpoint on the notice, and elastic's
    evacuation (``clusters.policy.EvacuationPolicy``, the live controller's, with copies)."""
    return [
        RestartAll(),
        RestartAll(name="restart-all+ckpt-on-notice", checkpoint_on_notice=True),
        ElasticInPlace(name="in-place, from checkpoint"),
        ElasticInPlace(name="in-place, from peers", peer_copy_every=peer_every),
        ElasticInPlace(name="evacuate on notice", peer_copy_every=peer_every,
                       evacuation=EvacuationPolicy()),
    ]


def make_cluster(name: str, od: int, spot: int, od_price: float, spot_price: float) -> Cluster:
    pools = []
    for pname, market, n, price in (("od", "on_demand", od, od_price),
                                    ("spot", "spot", spot, spot_price)):
        if n:
            pools.append({"name": pname, "device": DEVICE, "nodes": n, "devices_per_node": 8,
                          "network": "efa-100", "nics": 4, "market": market,
                          "price_per_device_hour": price})
    return load_cluster({"name": name, "pools": pools})


def memo_planner(profile, batch: int, strategies: Sequence[str] | None,
                 ) -> tuple[Callable[[Cluster], Callable[[Cluster], tuple[float, Plan | None]]],
                            dict[str, float]]:
    """Plans per (on-demand, spot) node count, as the live controller re-plans for survivors
    (``plan_cache(replan="keep")``): the whole cluster's layout family where it fits, else the
    planner's best; shared by every cluster and price of the same shape. Returns a maker of
    one cluster's evaluator, and the planner's call count and seconds."""
    memo: dict[tuple[object, ...], tuple[float, Plan | None, Cluster]] = {}
    stats = {"calls": 0.0, "seconds": 0.0}
    base = {"strategies": tuple(strategies)} if strategies else {}

    def planned(alive: Cluster, family: Plan | None) -> tuple[float, Plan | None]:
        shape = tuple((p.name, p.count) for p in alive.pools if p.count)
        fam = None if family is None else (family.strategy, family.dp_mode, family.schedule,
                                           family.pp_degree)
        key = (shape, fam)
        if key not in memo:
            t0 = time.perf_counter()
            ch = None
            if family is not None:
                kw = {**base, "strategies": (family.strategy,), "dp_modes": (family.dp_mode,),
                      "schedules": (family.schedule,), "subsets": False}
                if family.is_pipeline:
                    kw["max_pp"] = family.pp_degree
                ch = plan(alive, profile, batch, **kw).choice  # type: ignore[arg-type]
                stats["calls"] += 1
            if ch is None or ch.estimate is None:
                ch = plan(alive, profile, batch, **base).choice  # type: ignore[arg-type]
                stats["calls"] += 1
            stats["seconds"] += time.perf_counter() - t0
            memo[key] = ((math.inf, None, alive) if ch is None or ch.estimate is None
                         else (ch.estimate.step_time, ch.plan, alive))
        st, p, seen = memo[key]
        if p is not None and seen is not alive:  # the same plan here, nodes by position
            ids = {}
            for pool, _ in shape:
                here = [nd for nd in alive.nodes if nd.pool == pool]
                there = [nd for nd in seen.nodes if nd.pool == pool]
                for a_node, b_node in zip(there, here, strict=True):
                    for da, db in zip(a_node.devices, b_node.devices, strict=True):
                        ids[da.id] = db.id
            p = replace(p, devices=tuple(ids[d] for d in p.devices))
        return st, p

    def for_cluster(whole: Cluster) -> Callable[[Cluster], tuple[float, Plan | None]]:
        family = planned(whole, None)[1]
        return lambda alive: planned(alive, None if alive is whole else family)

    return for_cluster, stats


def run(cluster: Cluster, profile, batch: int, config: SimConfig, pols: Sequence[SimPolicy],
        evaluators) -> list[PolicyResult]:
    trace = failure_trace(cluster, config)
    return simulate(cluster, profile, batch, policies=pols, config=config, trace=trace,
                    evaluate=evaluators(cluster))


def fmt_row(label: str, r: PolicyResult, base: PolicyResult | None) -> str:
    h = r.duration_s / HOUR
    reached = "" if r.reached_target else " (not reached)"
    per_k = r.cost_per_1k_steps or math.nan
    if base is not None and r.reached_target and base.reached_target:
        speed = base.duration_s / r.duration_s
        saving = 1 - (r.cost_usd or 0) / (base.cost_usd or math.nan)
        rel = f"{speed:>7.2f}x {saving:>8.1%}"
    else:
        rel = f"{'-':>8} {'-':>8}"
    return (f"{label:<24}{r.policy:<28}{r.goodput:>8.1%}{r.preemptions:>8}{r.evacuations:>6}"
            f"{r.lost_steps:>8.0f}{h:>9.1f}{reached:<1}{(r.cost_usd or 0):>11,.0f}"
            f"{per_k:>9.2f} {rel}")


HEADER = (f"{'cluster':<24}{'system':<28}{'goodput':>8}{'preempt':>8}{'evac':>6}"
          f"{'lost':>8}{'hours':>9}{'cost $':>11}{'$/1k st':>9} {'speed-up':>8} {'saving':>8}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--od-nodes", type=int, default=16, help="on-demand-only cluster's nodes")
    ap.add_argument("--mixed-od", type=int, default=4, help="on-demand nodes in mixed clusters")
    ap.add_argument("--steps", type=int, default=20000, help="steps to train")
    ap.add_argument("--batch", type=int, default=1024, help="global batch (sequences)")
    ap.add_argument("--rate", type=float, default=0.01, help="preemptions per spot node-hour")
    ap.add_argument("--notice", type=float, default=120.0, help="notice lead time, s")
    ap.add_argument("--return-min", type=float, default=30.0,
                    help="minutes until a preempted node's capacity is back")
    ap.add_argument("--spot-discount", type=float, default=None,
                    help="spot price = on-demand x (1 - this); default: the catalog's spot")
    ap.add_argument("--checkpoint-every", type=int, default=200, help="steps")
    ap.add_argument("--peer-every", type=int, default=50, help="steps between buddy copies")
    ap.add_argument("--strategies", nargs="*", default=None, help="limit the planner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sensitivity", action="store_true",
                    help="vary rate, notice, return time and spot price (same-budget mixed)")
    ap.add_argument("--at-scale", action="store_true",
                    help="instead: time a simulated month on 10,000 GPUs (250 on-demand + "
                         "1,000 spot nodes), the five systems, G=20,480")
    a = ap.parse_args(argv)
    if a.at_scale:
        at_scale(a)
        return

    dev = device_type(DEVICE)
    od_price = dev.prices["on_demand"]
    spot_price = (dev.prices["spot"] if a.spot_discount is None
                  else od_price * (1 - a.spot_discount))
    profile = transformer_profile(layers=32, d_model=4096, n_heads=32, seq_len=2048,
                                  vocab=32000, name="llama-7b-like")
    evaluators, stats = memo_planner(profile, a.batch, a.strategies)
    config = SimConfig(duration_s=60 * 86400.0, target_steps=a.steps,
                       checkpoint_every=a.checkpoint_every, preemption_per_h={"spot": a.rate},
                       notice_s={"spot": a.notice}, preemption_return_s=a.return_min * 60,
                       seed=a.seed)
    n, m = a.od_nodes, a.mixed_od
    same_budget_spot = math.floor((n - m) * od_price / spot_price + 1e-9)
    clusters = [
        ("on-demand only", n, 0),
        ("mixed, same size", m, n - m),
        ("mixed, same budget", m, same_budget_spot),
        ("spot only, same budget", 0, math.floor(n * od_price / spot_price + 1e-9)),
    ]
    pols = systems(a.peer_every)
    print(f"{profile.name}: {profile.n_params / 1e9:.2f} B params, G={a.batch}, "
          f"{a.steps} steps; nodes of 8 x {DEVICE}; prices per device-hour: on-demand "
          f"${od_price:.2f}, spot ${spot_price:.2f}; spot preemptions {a.rate:g} per node-hour, "
          f"notice {a.notice:g} s, capacity back after {a.return_min:g} min; checkpoint every "
          f"{a.checkpoint_every} steps, buddy copies every {a.peer_every}")
    w0 = time.perf_counter()
    base: dict[str, PolicyResult] = {}
    print(HEADER)
    print("-" * len(HEADER))
    for label, od, spot in clusters:
        c = make_cluster(label, od, spot, od_price, spot_price)
        st, p = evaluators(c)(c)
        per_h = cluster_cost_per_hour(c) or math.nan
        print(f"# {label}: {od} on-demand + {spot} spot nodes ({8 * (od + spot)} GPUs), "
              f"${per_h:,.0f}/h; plan {p.label if p else '-'}, {st:.2f} s/step")
        for r in run(c, profile, a.batch, config, pols, evaluators):
            if label == "on-demand only":
                base[r.policy] = r
            print(fmt_row(label, r, base.get(r.policy)))
    print(f"({time.perf_counter() - w0:.1f} s; planner {stats['calls']:.0f} calls, "
          f"{stats['seconds']:.1f} s)")
    if a.sensitivity:
        sensitivity(a, profile, evaluators, config, pols, od_price, spot_price, base)


def sensitivity(a, profile, evaluators, config: SimConfig, pols: Sequence[SimPolicy],
                od_price: float, spot_price: float, base: dict[str, PolicyResult]) -> None:
    """The same-budget mixed cluster under other assumptions, one changed at a time."""
    m = a.mixed_od
    spot_n = math.floor((a.od_nodes - m) * od_price / spot_price + 1e-9)
    cases: list[tuple[str, SimConfig, float]] = []
    for rate in (0.002, 0.05, 0.2):
        cases.append((f"rate {rate:g}/node-h", replace(config, preemption_per_h={"spot": rate}),
                      spot_price))
    for notice in (30.0, 0.0):
        cases.append((f"notice {notice:g} s", replace(config, notice_s={"spot": notice}),
                      spot_price))
    for ret in (5.0, 120.0):
        cases.append((f"back after {ret:g} min",
                      replace(config, preemption_return_s=ret * 60), spot_price))
    for disc in (0.5, 0.8):  # the cluster stays as it is: only the bill changes
        cases.append((f"spot {disc:.0%} off", config, od_price * (1 - disc)))
    print(f"\nSensitivity: mixed, {m} on-demand + {spot_n} spot nodes (the same-budget cluster "
          "at the default prices), one assumption changed at a time; speed-up and saving "
          "against the same system on the on-demand-only cluster")
    print(HEADER)
    print("-" * len(HEADER))
    for label, cfg, sp in cases:
        c = make_cluster(label, m, spot_n, od_price, sp)
        for r in run(c, profile, a.batch, cfg, pols, evaluators):
            print(fmt_row(label, r, base.get(r.policy)))


def at_scale(a) -> None:
    """A simulated month on 250 on-demand + 1,000 spot nodes (10,000 A100s), the five
    systems over one trace, plans as the live controller re-plans (``replan="keep"``): the
    simulator's own speed at this size, and the table."""
    dev = device_type(DEVICE)
    c = make_cluster("a100-10k-mixed", 250, 1000, dev.prices["on_demand"], dev.prices["spot"])
    profile = transformer_profile(layers=32, d_model=4096, n_heads=32, seq_len=2048,
                                  vocab=32000, name="llama-7b-like")
    config = SimConfig(duration_s=30 * 86400.0, checkpoint_every=a.checkpoint_every,
                       preemption_per_h={"spot": a.rate}, notice_s={"spot": a.notice},
                       preemption_return_s=a.return_min * 60, seed=a.seed)
    t0 = time.perf_counter()
    trace = failure_trace(c, config)
    t1 = time.perf_counter()
    plans = plan_cache(c, profile, 20480, replan="keep")
    res = simulate(c, profile, 20480, policies=systems(a.peer_every), config=config,
                   trace=trace, plans=plans)
    t2 = time.perf_counter()
    n_pre = sum(e.kind == "preempted" for e in trace)
    print(f"a simulated month on {len(c.devices):,} GPUs ({c.name}), {len(trace):,} trace events "
          f"({n_pre:,} preemptions at {a.rate:g} per spot node-hour); full plan "
          f"{plans.entry(frozenset()).plan.label}")  # type: ignore[union-attr]
    print(f"wall {t2 - t0:.1f} s: trace {t1 - t0:.2f} s, planner {plans.calls} compositions "
          f"{plans.seconds:.1f} s, event loop (5 systems) {t2 - t1 - plans.seconds:.1f} s")
    print(format_sim_table(res))


if __name__ == "__main__":
    main()
