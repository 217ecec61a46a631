"""Scheduler benchmark: many elastic jobs on one small Ray cluster, each policy against
FIFO-static side by side in one run, and the same policies in the simulator.

Live part: a ``ray.cluster_utils.Cluster`` (a head with no CPUs and ``--nodes`` worker nodes
of 1 CPU; default 4) and, per policy, a fresh elastic scheduler owning one worker per CPU.
The trace (``TRACE``, or ``--jobs N``: ``random_trace``'s N jobs drawn from a stated
distribution, seed ``--trace-seed``): 8 jobs of 1-4 requested workers and 30-300 steps
arriving over 22 s;
each job's step costs ``--ms-per-sample`` ms per sample, divided among its workers (the
model's forward sleeps it: a compute-bound job's step time on this 2-core test machine), a
global batch of 12. Every job runs through the live scheduler: ``elastic.submit(...,
scheduler=...)``, the in-place resize at step boundaries. Reported per policy: mean job
completion time (submission to end), makespan (first submission to last end), utilisation
(worker-seconds held / capacity x makespan), resizes and the seconds they took, each job's
largest parameter difference from its single-process run (must be < 1e-5: the scheduler must
not change what a job trains), and the ratio to FIFO-static.

Simulated part: the live trace, and ``--small-traces`` random traces like it (8 and 16
jobs), in the simulator with the live run's measured start, resize and step costs: what a
policy is expected to gain on such a cluster, to read one live trace against. Then the same
policy classes (``clusters.sched_policy``) over a synthetic Philly-like week on 1,000 GPUs
(``clusters.job_trace``), CPU seconds per simulated week.

A benchmark, not a test: it checks nothing. From the repository root:
``python bench/scheduler.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusters.job_trace import TraceJob, job_trace  # noqa: E402 - after the path set-up above
from clusters.sched_policy import POLICIES, Option, policy_named  # noqa: E402
from clusters.sched_sim import (  # noqa: E402
    SchedSimConfig,
    format_sched_table,
    simulate_schedule,
    trace_options,
)

BATCH = 12  # divides among 1..4 workers


@dataclass(frozen=True)
class TraceEntry:
    name: str
    at_s: float
    steps: int
    requested: int
    lo: int
    hi: int


TRACE = (
    TraceEntry("big-a", 0.0, 300, 4, 1, 4),
    TraceEntry("small-b", 2.0, 40, 2, 1, 2),
    TraceEntry("small-c", 4.0, 40, 1, 1, 2),
    TraceEntry("mid-d", 6.0, 200, 2, 1, 4),
    TraceEntry("tiny-e", 10.0, 30, 1, 1, 1),
    TraceEntry("mid-f", 14.0, 60, 2, 1, 4),
    TraceEntry("tiny-g", 18.0, 30, 1, 1, 2),
    TraceEntry("mid-h", 22.0, 100, 3, 1, 4),
)


FIXED_S = 0.01  # a step's part that does not divide among workers here (gloo, the loop)
# what a start and a resize took in the live runs of 2026-12-02 (warm pool / cold processes)
START_S = {True: 0.4, False: 10.0}
RESIZE_S = {True: 0.7, False: 5.0}


def random_trace(n: int, seed: int, nodes: int, ms_per_sample: float, load: float = 1.0
                 ) -> tuple[TraceEntry, ...]:
    """``n`` jobs drawn (deterministic per ``seed``): steps lognormal (median 80, sigma 0.8,
    20-400), 1-4 workers asked (1 and 2 twice as likely as 3 and 4), ``max_workers`` from the
    asked size up to ``nodes``, ``min_workers`` 1; Poisson arrivals that offer ``load`` x the
    cluster's capacity of work over the arrival span."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        steps = int(min(400, max(20, rng.lognormvariate(math.log(80), 0.8))))
        asked = min(rng.choice((1, 1, 2, 2, 3, 4)), nodes)
        specs.append((steps, asked, rng.choice([h for h in range(1, nodes + 1) if h >= asked])))
    one = ms_per_sample / 1000.0 * BATCH + FIXED_S  # a step on one worker
    span = sum(st * one for st, _, _ in specs) / (nodes * load)
    out, t = [], 0.0
    for i, (steps, asked, hi) in enumerate(specs):
        out.append(TraceEntry(f"r{i:02d}", round(t, 1), steps, asked, 1, hi))
        t += rng.expovariate(n / span)
    return tuple(out)


def sim_jobs(trace: tuple[TraceEntry, ...], ms_per_sample: float
              ) -> tuple[list[TraceJob], Any]:
    """A live trace as the simulator's jobs, each step ``ms x batch / n + FIXED_S``."""
    compute = ms_per_sample / 1000.0 * BATCH

    def options(j: TraceJob) -> tuple[Option, ...]:
        return tuple(Option(n, "dp", compute / n + FIXED_S)
                     for n in range(j.min_workers, j.max_workers + 1))

    jobs = [TraceJob(e.name, e.at_s, e.requested, e.lo, e.hi,
                     e.steps * (compute / e.requested + FIXED_S), "live") for e in trace]
    return jobs, options


def sim_small(trace: tuple[TraceEntry, ...], nodes: int, ms_per_sample: float, warm: bool,
              resize_s: float, seeds: int) -> str:
    """The live trace in the simulator, then ``seeds`` random traces like it (8 and 16 jobs):
    what the policies are expected to gain on this cluster, so one live trace's figure can be
    read against a distribution rather than alone."""
    cfg = SchedSimConfig(round_s=0.5, start_s=START_S[warm], resize_s=RESIZE_S[warm])
    policies = [policy_named(p, resize_s=resize_s, max_wait_s=120.0) for p in POLICIES]

    def ratios(tr: tuple[TraceEntry, ...]) -> dict[str, float]:
        jobs, options = sim_jobs(tr, ms_per_sample)
        res = {p.name: simulate_schedule(jobs, nodes, p, options, cfg).mean_jct_s
               for p in policies}
        return {k: v / res["fifo-static"] - 1 for k, v in res.items() if k != "fifo-static"}

    lines = [f"simulated like the live run ({'warm' if warm else 'cold'}: start "
             f"{cfg.start_s:g} s, resize {cfg.resize_s:g} s, step {ms_per_sample:g} ms x "
             f"{BATCH} / n + {FIXED_S * 1000:g} ms), mean JCT vs fifo-static:"]
    lines.append("  this trace: " + ", ".join(f"{k} {v:+.0%}" for k, v in ratios(trace).items()))
    for n in (8, 16):
        got: dict[str, list[float]] = {}
        for seed in range(seeds):
            for k, v in ratios(random_trace(n, 1000 + seed, nodes, ms_per_sample)).items():
                got.setdefault(k, []).append(v)
        lines.append(f"  {seeds} random traces of {n} jobs (load 1.0): " + ", ".join(
            f"{k} mean {statistics.mean(v):+.0%}, median {statistics.median(v):+.0%}, "
            f"{sum(x <= -0.3 for x in v) / len(v):.0%} at -30 % or better"
            for k, v in got.items()))
    return "\n".join(lines)


@dataclass
class LiveResult:
    policy: str
    capacity: int
    rows: list[dict[str, Any]]
    diffs: dict[str, float]
    wall_s: float
    trace: tuple[TraceEntry, ...] = TRACE

    def _done(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["state"] == "finished"]

    @property
    def mean_jct_s(self) -> float:
        d = self._done()
        if len(d) < len(self.rows):
            return math.inf
        return sum(r["ended_s"] - r["submitted_s"] for r in d) / len(d)

    @property
    def makespan_s(self) -> float:
        if not self.rows or any(r["ended_s"] is None for r in self.rows):
            return math.inf
        return max(r["ended_s"] for r in self.rows) - min(r["submitted_s"] for r in self.rows)

    @property
    def utilisation(self) -> float:
        span = self.makespan_s
        return sum(r["worker_s"] for r in self.rows) / (self.capacity * span) if span else 0.0

    @property
    def resizes(self) -> int:
        return sum(r["resizes"] for r in self.rows)

    @property
    def resize_s(self) -> float:
        return sum(r["resize_s"] for r in self.rows)


def run_live(policy: str, nodes: int, ms_per_sample: float, resize_s: float,
             run_root: str, warm: int = 0, trace: tuple[TraceEntry, ...] = TRACE) -> LiveResult:
    """One policy over ``trace`` on a fresh cluster; every job checked against its solo run.
    ``warm``: the scheduler keeps that many warm workers (its pool is up before the trace
    starts, as a long-lived scheduler's would be)."""
    import ray
    from ray.cluster_utils import Cluster

    import elastic
    from bench import _sched_jobs as jobs
    from elastic import scheduler
    from elastic.reference import reference_train

    factory = functools.partial(jobs.model, ms_per_sample / 1000.0)
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        name = f"bench-{policy}"
        sched = scheduler.start(name, workers=nodes, policy=policy, round_s=0.5,
                                resize_s=resize_s, max_wait_s=120.0, detached=False, warm=warm)
        deadline = time.monotonic() + 120
        while warm and (ray.get(sched.info.remote())["pool"] or {}).get("idle", 0) < min(
                warm, nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler's {warm} warm workers did not start")
            time.sleep(0.5)
        t0 = time.monotonic()
        handles = {}
        for e in trace:
            wait = e.at_s - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)
            handles[e.name] = elastic.submit(
                model=factory, optimizer=jobs.optimizer, loss=jobs.loss, dataset=jobs.Data(),
                global_batch_size=BATCH, max_steps=e.steps, num_workers=e.requested,
                min_workers=e.lo, max_workers=e.hi, view="none", name=e.name,
                run_dir=os.path.join(run_root, policy, e.name), scheduler=name)
        results = {n: h.result(timeout=1800) for n, h in handles.items()}
        wall = time.monotonic() - t0
        rows = ray.get(sched.rows.remote())
        sinfo = ray.get(sched.info.remote())
        errors = sinfo["errors"]
        if sinfo.get("pool"):
            print(f"  {policy}: the warm pool: {sinfo['pool']}", flush=True)
        if errors:
            print(f"  {policy}: scheduler loop errors: {errors}", flush=True)
        scheduler.shutdown(name)
    finally:
        ray.shutdown()
        cluster.shutdown()
    diffs = {}
    for e in trace:
        out = results[e.name]
        if out["state_dict"] is None:
            diffs[e.name] = math.inf
            continue
        ref, _ = reference_train(factory, jobs.optimizer, jobs.loss, jobs.Data(), BATCH,
                                 out["steps"], seed=0)
        diffs[e.name] = max(float((out["state_dict"][k] - v).abs().max()) for k, v in ref.items())
    return LiveResult(policy, nodes, rows, diffs, wall, trace)


def format_live(results: list[LiveResult]) -> str:
    base = next(r for r in results if r.policy == "fifo-static")
    hdr = (f"{'policy':<13}{'mean JCT':>10}{'vs fifo':>9}{'makespan':>10}{'vs fifo':>9}"
           f"{'util':>7}{'resizes':>9}{'resizing':>10}{'max |dp|':>10}{'wall':>8}")
    out = [hdr, "-" * len(hdr)]
    for r in results:
        vs = "" if r is base else f"{r.mean_jct_s / base.mean_jct_s - 1:+.0%}"
        vm = "" if r is base else f"{r.makespan_s / base.makespan_s - 1:+.0%}"
        out.append(f"{r.policy:<13}{r.mean_jct_s:>9.1f}s{vs:>9}{r.makespan_s:>9.1f}s{vm:>9}"
                   f"{r.utilisation:>7.0%}{r.resizes:>9}{r.resize_s:>9.1f}s"
                   f"{max(r.diffs.values()):>10.1e}{r.wall_s:>7.0f}s")
    return "\n".join(out)


def format_jobs(r: LiveResult) -> str:
    out = [f"  {r.policy}: job (arrival, steps, asked) -> start, end, JCT, resizes"]
    by = {row["job"]: row for row in r.rows}
    for e in r.trace:
        row = by[e.name]
        start = row["started_s"] - row["submitted_s"] if row["started_s"] is not None else math.nan
        jct = row["ended_s"] - row["submitted_s"] if row["ended_s"] is not None else math.nan
        out.append(f"    {e.name:<8} ({e.at_s:>4.0f}s, {e.steps:>3}, {e.requested}) -> waited "
                   f"{start:5.1f}s, JCT {jct:6.1f}s, {row['resizes']} resizes, {row['state']}"
                   + (f": {row['error']}" if row.get("error") else ""))
    return "\n".join(out)


def run_sim(days: float, gpus: int, seed: int) -> str:
    trace = job_trace(duration_s=days * 86400, capacity=gpus, load=0.8, seed=seed)
    opts = trace_options()
    for j in trace:
        opts(j)  # the planner's tables, once per model
    results, cpu = [], {}
    for name in POLICIES:
        t0 = time.process_time()
        results.append(simulate_schedule(trace, gpus, policy_named(name), opts,
                                         SchedSimConfig()))
        cpu[name] = time.process_time() - t0
    lines = [f"simulated: {len(trace)} jobs over {days:g} days on {gpus} GPUs (Philly-like, "
             f"load 0.8, seed {seed})", format_sched_table(results)]
    lines += [f"  {n}: {cpu[n]:.2f} s CPU, {cpu[n] / (days / 7):.2f} s per simulated week"
              for n in POLICIES]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4, help="1-CPU worker nodes (default 4)")
    ap.add_argument("--ms-per-sample", type=float, default=10.0)
    ap.add_argument("--resize-s", type=float, default=5.0,
                    help="the policies' hysteresis: what a resize is taken to cost")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; fifo-static always runs (the baseline)")
    ap.add_argument("--no-live", action="store_true", help="only the simulator")
    ap.add_argument("--days", type=float, default=7.0, help="simulated days (default 7)")
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warm", type=int, default=0,
                    help="warm workers each policy's scheduler keeps (default 0: cold starts)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="a random trace of this many jobs (random_trace) instead of the "
                         "fixed 8-job TRACE")
    ap.add_argument("--trace-seed", type=int, default=0, help="the random trace's seed")
    ap.add_argument("--small-traces", type=int, default=200,
                    help="random traces like the live one for the simulator's distribution")
    a = ap.parse_args(argv)
    trace = (random_trace(a.jobs, a.trace_seed, a.nodes, a.ms_per_sample) if a.jobs else TRACE)
    if a.jobs:
        print("trace: " + ", ".join(f"{e.name} (at {e.at_s:g}s, {e.steps} steps, asked "
                                    f"{e.requested}, max {e.hi})" for e in trace))
    if not a.no_live:
        names = ["fifo-static"] + [p for p in a.policies.split(",") if p and p != "fifo-static"]
        results = []
        with tempfile.TemporaryDirectory(prefix="elastic-sched-bench-") as root:
            for p in names:
                print(f"[bench] live: {p} ...", flush=True)
                results.append(run_live(p, a.nodes, a.ms_per_sample, a.resize_s, root,
                                        a.warm, trace))
        print(f"live: {len(trace)} jobs on a {a.nodes}-CPU ray.cluster_utils.Cluster, "
              f"{a.ms_per_sample:g} ms/sample, batch {BATCH}, {a.warm} warm workers")
        print(format_live(results))
        for r in results:
            print(format_jobs(r))
    if a.small_traces:
        print(sim_small(trace, a.nodes, a.ms_per_sample, a.warm > 0, a.resize_s,
                        a.small_traces))
    print(run_sim(a.days, a.gpus, a.seed))


if __name__ == "__main__":
    main()
