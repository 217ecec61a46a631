"""Where a pipeline's step goes, measured against the cost model's parts, outside Ray: N spawned
gloo processes (1 thread each) profile a planner family (bench/_planner_models.py) as a job's
workers do (``elastic.worker.measure.profile_terms``), rank 0 builds the cost model from the
reports (``elastic.planning.measured_model``), then each pipeline layout (pp = N) runs with its
phases timed on every rank: the schedule (``schedule.step``: micro-batches, p2p, bubble), and
the rest of the step (the batch's all-gathers, the norm's and the commit's all-reduces, the
update), as the profiler's pipeline trial times them (``elastic.worker.trial.pipeline_trial``). Printed
side by side with the model's compute (its schedule) and the rest of its step, so that a
term whose count or level is off shows as the phase that misses. The model is fitted to the
profile's own pipeline trial: a layout at the trial's micro-batch counts is in its sample.

    python bench/pipeline_phases.py --family dlrm --workers 3 --layouts 1f1b:4 1f1b:8 gpipe:4

A benchmark, not a test: it never fails on a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != BENCH] + [BENCH]


def _timed(obj: Any, name: str, into: list[float]) -> None:
    real = getattr(obj, name)

    def run(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)
    setattr(obj, name, run)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from _strat_common import join_gloo_family

    from elastic.worker.measure import profile_terms
    from strategies import Runtime, StrategySpec, get
    from strategies.errors import StrategyError

    fam, data, shares, lo = join_gloo_family(rank, world, port, args.family)
    g = fam.global_batch

    def batch(step: int) -> Any:
        start = (step * g) % (len(data) - g)
        xs, ys = zip(*(data[i] for i in range(start, start + g)), strict=True)
        return torch.stack(xs)[lo:lo + shares[rank]], torch.stack(ys)[lo:lo + shares[rank]]

    def adam(params: Any) -> Any:
        return torch.optim.Adam(params, lr=1e-4)

    def spec_of(lay: str) -> Any:
        sched, m = lay.split(":")
        return StrategySpec("pipeline", world, tuple(shares), pp_degree=world,
                            micro_batches=int(m), schedule=sched)

    rep = profile_terms(model_factory=fam.model, loss_fn=fam.loss, optimizer_factory=adam,
                        batch=batch, shares=shares, rank=rank, world=world,
                        device=torch.device("cpu"), autocast=contextlib.nullcontext,
                        rounds=args.rounds)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, rep)
    layouts = []
    for lay in args.layouts:
        try:
            get("pipeline").validate(spec_of(lay), fam.model())
            layouts.append(lay)
        except StrategyError as e:
            if rank == 0:
                print(f"  {lay}: not run ({e})", flush=True)
    predicted: dict[str, dict[str, float]] = {}
    if rank == 0:
        from elastic.planning import measured_model, spec_plan

        infos = [{"rank": r, "device": "cpu", "device_name": "cpu", "node_id": "n0",
                  "hostname": socket.gethostname(), "threads": 1,
                  "host_cores": os.cpu_count() or 1, "emulation": {}} for r in range(world)]
        cluster, mm = measured_model(fam.model(), "adam", infos, reports)
        ids = [d.id for d in cluster.devices]
        for lay in layouts:
            est = mm.model.estimate(spec_plan(spec_of(lay), ids, fam.model()), cluster,
                                    mm.profile)
            predicted[lay] = {"step": est.step_time, "schedule": est.compute,
                              "rest": est.step_time - est.compute}
    measured: dict[str, dict[str, float]] = {}
    for lay in layouts:
        torch.manual_seed(0)
        strat = get("pipeline")(spec_of(lay), Runtime.current(), fam.model(), adam, fam.loss)
        sched: list[float] = []
        _timed(strat.schedule, "step", sched)
        steps = []
        try:
            for step in range(args.warmup + args.steps):
                x, y = batch(step)
                dist.barrier()
                t0 = time.perf_counter()
                strat.train_step(x, y)
                steps.append(time.perf_counter() - t0)
        finally:
            strat.close()
        w = args.warmup
        measured[lay] = {"step": statistics.median(steps[w:]),
                         "schedule": statistics.median(sched[w:])}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, measured)
    if rank == 0:
        out.put({"predicted": predicted, "measured": every})
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="dlrm")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=["1f1b:4", "1f1b:8", "gpipe:4"],
                    help="SCHEDULE:MICRO_BATCHES, pp = --workers")
    ap.add_argument("--rounds", type=int, default=7, help="the profile's repeats")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import _strat_common

    t0 = time.time()
    res = _strat_common.run_gloo_ranks(_rank, args.workers, args, timeout_s=1800)
    print(f"{args.family}, pp = {args.workers} gloo workers, {args.steps} steps per layout "
          f"({args.warmup} warm-up), {time.time() - t0:.0f} s; ms, measured: the slowest "
          "rank's median step and schedule, the rest the difference (the model's split: the "
          "first stage's schedule spans the pipeline, the others wait for it after theirs)")
    print("| layout | step measured | predicted | error | schedule measured | predicted | "
          "error | rest measured | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lay, p in res["predicted"].items():
        m = {k: max(r[lay][k] for r in res["measured"]) for k in ("step", "schedule")}
        m["rest"] = m["step"] - m["schedule"]
        cells = [f"{m[k] * 1e3:.1f} | {p[k] * 1e3:.1f} | {p[k] / m[k] - 1:+.0%}"
                 for k in ("step", "schedule", "rest")]
        print(f"| {lay} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
