"""Simulator benchmark: how long the failure simulator takes for a simulated month at scale.

Workload: ``clusters/examples/a100-10k.yaml`` (1,250 nodes x 8 A100-80GB, 10,000 GPUs) or
``--nodes N`` of the same kind, a Llama-2-7B-like transformer (32 layers, d 4096, 32 heads,
sequence 2048, vocabulary 32,000, bf16, Adam), global batch ``--batch`` (default 20,480
sequences), the full planner (every strategy, pipelines and hybrids) at each pool
composition. Failures: ``--trace FILE`` (CSV or JSON Lines, ``clusters.load_trace``) or a
Llama-3-like trace (``clusters.llama3_trace``, ``--mttf-h`` hours job-level MTTF at 16,384
GPUs; default 1.8 h, the figure issue 16 quotes; Llama 3's own 419 interruptions in 54 days
are 3.1 h: ``--mttf-h 3.09``), 8 % spare nodes by default.

Printed: wall and CPU seconds for the simulated span (both policies), per simulated week and
month, the planner's share (calls, seconds), and the policies' table. ``--sweep`` adds a
checkpoint-interval sweep for restart-all with a blocking checkpoint, next to Young's and
Daly's interval. A benchmark, not a test: it checks nothing. Run from the repository root:
``python bench/simulator.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusters import (  # noqa: E402 - after the path set-up above
    ElasticInPlace,
    RestartAll,
    SimConfig,
    checkpoint_sweep,
    example_path,
    format_checkpoint_sweep,
    format_sim_table,
    llama3_trace,
    load_cluster,
    load_trace,
    plan_cache,
    save_trace,
    simulate,
    transformer_profile,
)
from clusters.topology import Cluster  # noqa: E402

DAY = 86400.0


def _cluster(nodes: int | None, name: str | None = None) -> Cluster:
    if name is not None:
        return load_cluster(name if os.path.exists(name) else example_path(name))
    if nodes is None:
        return load_cluster(example_path("a100-10k"))
    return load_cluster({"name": f"a100-{nodes * 8}", "pools": [{
        "name": "a100", "device": "A100-80GB", "nodes": nodes, "devices_per_node": 8,
        "network": "ib-hdr", "nics": 8}]})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=None, help="8-GPU nodes (default: a100-10k)")
    ap.add_argument("--cluster", default=None,
                    help="a cluster file or example name instead (e.g. mixed-10k)")
    ap.add_argument("--days", type=float, default=30.0, help="simulated days (default 30)")
    ap.add_argument("--batch", type=int, default=20480, help="global batch (sequences)")
    ap.add_argument("--mttf-h", type=float, default=1.8,
                    help="job-level MTTF at 16,384 GPUs in hours (default 1.8)")
    ap.add_argument("--spares", type=float, default=0.08, help="spare nodes, share of nodes")
    ap.add_argument("--checkpoint-every", type=int, default=200, help="steps")
    ap.add_argument("--trace", help="a failure-trace file (.csv or .jsonl) instead of llama3")
    ap.add_argument("--save-trace", help="write the trace used to this file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replan", choices=("best", "keep"), default="best",
                    help="plan_cache's replan: the best plan per composition (default) or the "
                         "whole cluster's layout family on the survivors")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep restart-all's checkpoint interval (blocking checkpoints)")
    args = ap.parse_args(argv)

    cluster = _cluster(args.nodes, args.cluster)
    profile = transformer_profile(layers=32, d_model=4096, n_heads=32, seq_len=2048,
                                  vocab=32000, name="llama-7b-like")
    duration = args.days * DAY
    trace = (load_trace(args.trace, cluster) if args.trace else
             llama3_trace(cluster, duration, seed=args.seed, job_mttf_h=args.mttf_h))
    if args.save_trace:
        save_trace(trace, args.save_trace)
    spares = round(args.spares * len(cluster.nodes))
    config = SimConfig(duration_s=duration, checkpoint_every=args.checkpoint_every,
                       spare_nodes={"*": spares}, seed=args.seed)
    n = len(cluster.devices)
    print(f"{cluster.name}: {len(cluster.nodes)} nodes, {n} GPUs; {profile.name} "
          f"({profile.n_params / 1e9:.2f} B params), G={args.batch}; {args.days:g} days, "
          f"{len(trace)} failures ({duration / max(1, len(trace)) / 3600:.2f} h apart), "
          f"{spares} spare nodes")

    plans = plan_cache(cluster, profile, args.batch, replan=args.replan)
    w0, c0 = time.perf_counter(), time.process_time()
    results = simulate(cluster, profile, args.batch, config=config, trace=trace, plans=plans,
                       policies=(RestartAll(), RestartAll(name="restart-shrink", shrink=True),
                                 ElasticInPlace()))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    weeks = args.days / 7
    print(f"simulated {args.days:g} days, 3 policies: {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"({wall / weeks:.2f} s per simulated week, {wall / weeks * 30 / 7:.2f} s per "
          f"simulated month); planner: {plans.calls} calls, {plans.seconds:.2f} s")
    full = plans.entry(frozenset())
    print(f"whole cluster: {full.plan.label if full.plan else '-'}, "
          f"{full.step_time:.3f} s/step")
    print(format_sim_table(results))

    if args.sweep:
        stall = profile.n_params * (profile.bytes_per_param
                                    + profile.optimizer_bytes_per_param) / config.storage_bandwidth
        swept = SimConfig(duration_s=duration, checkpoint_every=args.checkpoint_every,
                          checkpoint_stall_s=stall, spare_nodes={"*": spares}, seed=args.seed)
        every = [25, 50, 100, 200, 400, 800, 1600]
        w0 = time.perf_counter()
        rows = checkpoint_sweep(cluster, profile, args.batch, every, policy=RestartAll(),
                                config=swept, trace=trace, plans=plans)
        print(f"\nrestart-all, blocking checkpoints of {stall:.0f} s "
              f"(state / {config.storage_bandwidth / 1e9:g} GB/s), {len(every)} runs in "
              f"{time.perf_counter() - w0:.2f} s:")
        print(format_checkpoint_sweep(rows, full.step_time, stall,
                                      duration / max(1, len(trace))))


if __name__ == "__main__":
    main()
