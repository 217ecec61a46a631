"""The body of bench/strategies.py (see its docstring); kept here so that importing
the name ``strategies`` from bench/ never runs benchmark code."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _strat_common as common  # noqa: E402
from _strat_profile import euler_cycle, label, layouts  # noqa: E402

G = 32
MICRO = 4
WORKLOAD = common.WORKLOADS["mlp"]  # --model sets it


def _wait(cond: Any, handle: Any, timeout: float, what: str) -> None:
    t0 = time.time()
    while not cond():
        if handle.done():
            handle.result()  # raises the job's error
            raise RuntimeError(f"the job ended while waiting for {what}")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}: {handle.status()}")
        time.sleep(0.02)


def _switch(handle: Any, lay: tuple[str, str]) -> dict[str, Any]:
    """Ask for ``lay``; return the switch event's figures and the call's wall time."""
    ctl = handle.controller
    name, sched = lay
    if name == "pipeline":
        ctl.cfg.schedule = sched
    n_ev = len(ctl.events)
    t0 = time.time()
    handle.switch(name, reason="bench", timeout=300)
    wall = time.time() - t0
    ev = [e for e in ctl.events[n_ev:] if e.kind == "switch"][-1]
    return {"seconds": ev.data["seconds"], "state_preserved": ev.data["state_preserved"],
            "call_wall_s": wall, "hist_at_switch": ev.step, "step": ev.step,
            "bytes_moved": ev.data.get("bytes_moved", 0)}


def _steady(history: list[dict[str, Any]], lo: int, hi: int) -> dict[str, float]:
    """Throughput over history[lo:hi] (rank 0's step-end times) and median step time."""
    win = history[lo:hi]
    prev = history[lo - 1]["time"] if lo > 0 else None
    t_first = prev if prev is not None else win[0]["time"] - win[0]["step_time"]
    span = win[-1]["time"] - t_first
    med = statistics.median(h["step_time"] for h in win)
    return {"samples_per_s": G * len(win) / span, "median_step_s": med,
            "median_samples_per_s": G / med, "max_step_s": max(h["step_time"] for h in win)}


def _job(world: int, tmp: str, name: str, **kw: Any) -> Any:
    import elastic

    cfg = dict(model=WORKLOAD["model"], optimizer=dict(common.OPTIM), loss=WORKLOAD["loss"],
               dataset=WORKLOAD["dataset"], global_batch_size=G, max_steps=10_000_000,
               num_workers=world, strategy="dp", micro_batches=MICRO, schedule="gpipe",
               view="none", run_dir=os.path.join(tmp, name), name=name, hang_timeout_s=300,
               seed=common.SEED)
    cfg.update(kw)
    return elastic.submit(**cfg)


def fresh_peaks(world: int, args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    """One short fresh job per layout: each worker's VmHWM (peak RSS over the process's
    life) after ``--fresh-steps`` steps, so no earlier layout's memory is counted."""
    out = []
    for name, sched in layouts():
        lay = label((name, sched))
        if args.layouts and lay not in args.layouts:
            continue
        handle = _job(world, tmp, f"fresh-{lay}-w{world}", strategy=name, schedule=sched)
        try:
            ctl = handle.controller
            _wait(lambda c=ctl: len(c.history) >= args.fresh_steps, handle, 600, f"fresh {lay}")
            pids = [w.info["pid"] for w in ctl.workers]
            mems = [common.proc_mem_mb(p) for p in pids]
            hist = list(ctl.history)
        finally:
            handle.stop(timeout=300)
            handle.result(timeout=300)
        rec = {"world": world, "layout": lay, "hwm_mb": [m["hwm_mb"] for m in mems],
               "rss_mb": [m["rss_mb"] for m in mems],
               "step_times": [h["step_time"] for h in hist]}
        out.append(rec)
        print(f"[w={world}] fresh {lay:15s} peak RSS (VmHWM) per worker "
              f"{', '.join(f'{x:.0f}' for x in rec['hwm_mb'])} MB after {len(hist)} steps",
              flush=True)
    return out


def pair_walk(handle: Any, world: int, rounds: int, cur: int, move: str
              ) -> tuple[list[dict[str, Any]], int]:
    """Every ordered pair of layouts once per round (an Euler cycle from layout ``cur``);
    returns the switches and the layout the job ends in."""
    ctl = handle.controller
    lays = layouts()
    switches: list[dict[str, Any]] = []
    walk = euler_cycle(len(lays))
    k = walk.index(cur)  # rotate the closed walk so that it starts where the job is
    walk = walk[k:-1] + walk[:k] + [cur]
    for rnd in range(rounds):
        for nxt in walk[1:]:
            frm = cur
            sw = _switch(handle, lays[nxt])
            cur = nxt
            lo = sw["hist_at_switch"]
            _wait(lambda n=lo: len(ctl.history) >= n + 1, handle, 300, "a step after a switch")
            first = ctl.history[lo]
            rec = {"world": world, "round": rnd, "move": move, "from": label(lays[frm]),
                   "to": label(lays[nxt]), **sw, "first_step_s": first["step_time"],
                   "first_step_strategy": first["strategy"]}
            switches.append(rec)
            print(f"[w={world} {move}] switch {rec['from']:>15s} -> {rec['to']:15s} "
                  f"{sw['seconds']:6.3f}s (call {sw['call_wall_s']:6.3f}s, first step "
                  f"{rec['first_step_s']:6.3f}s, {sw['bytes_moved'] / 1e6:6.1f} MB moved, "
                  f"state preserved {sw['state_preserved']})", flush=True)
    return switches, cur


def bench_world(world: int, args: argparse.Namespace, sampler: common.Sampler,
                tmp: str) -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=world, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    handle = None
    try:
        fresh = fresh_peaks(world, args, tmp) if args.fresh_steps > 0 else []
        t_submit = time.time()
        handle = _job(world, tmp, f"strat-w{world}")
        ctl = handle.controller
        _wait(lambda: len(ctl.history) >= 2, handle, 600, "the first steps")
        print(f"[w={world}] first steps after {time.time() - t_submit:.1f}s", flush=True)
        pids = [w.info["pid"] for w in ctl.workers]
        sampler.pids = pids
        lays = [x for x in layouts() if not args.layouts or label(x) in args.layouts]
        cur = 0  # the job starts in dp (the first layout)
        steady: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for i, lay in enumerate(lays):
                sw = None
                if i != cur:
                    sw = _switch(handle, lay)
                    cur = i
                    lo = sw["hist_at_switch"]
                else:
                    lo = len(ctl.history)
                start = lo + args.warmup
                _wait(lambda s=start: len(ctl.history) >= s + args.steps, handle, 900,
                      f"{args.steps} steps of {label(lay)}")
                hist = list(ctl.history)
                t_a = hist[start - 1]["time"]
                t_b = hist[start + args.steps - 1]["time"]
                s = _steady(hist, start, start + args.steps)
                win = sampler.window(t_a, t_b)
                mem = handle.controller_memory(timeout=300)
                rec = {"world": world, "round": rnd, "layout": label(lay), **s,
                       "first_step_s": hist[lo]["step_time"] if sw else None,
                       "memory_elements": mem,
                       "model_state_mb": [4 * (m["params"] + m["grads"] + m["optim"]) / 1e6
                                          for m in mem],
                       "peak_rss_mb": [win.get("peak_rss_mb", {}).get(p, float("nan"))
                                       for p in pids],
                       "machine_cores": win.get("machine_cores"),
                       "workers_cores": win.get("workers_cores"),
                       "strategy_in_history": hist[start]["strategy"],
                       "switch": sw}
                steady.append(rec)
                print(f"[w={world}] round {rnd + 1} {label(lay):15s} "
                      f"{s['samples_per_s']:7.1f} samples/s (median step {s['median_step_s'] * 1e3:6.1f} ms)"
                      f"  states/rank {', '.join(f'{x:.0f}' for x in rec['model_state_mb'])} MB"
                      f"  peak RSS {', '.join(f'{x:.0f}' for x in rec['peak_rss_mb'])} MB"
                      f"  machine {rec['machine_cores'] or float('nan'):.2f} cores, workers "
                      f"{rec['workers_cores'] or float('nan'):.2f}", flush=True)
        cur = layouts().index(lays[cur])
        switches, cur = pair_walk(handle, world, args.pair_rounds, cur, "reshard")
        hwm = [common.proc_mem_mb(p)["hwm_mb"] for p in pids]
        handle.stop(timeout=300)
        res = handle.result(timeout=300)
        handle = None
        compare = {}
        for move in args.compare_moves:  # the same walk in a fresh job that moves otherwise
            handle = _job(world, tmp, f"strat-w{world}-{move}", switch_move=move)
            _wait(lambda h=handle: len(h.controller.history) >= 2, handle, 600, "first steps")
            walk_pids = [w.info["pid"] for w in handle.controller.workers]
            sws, _ = pair_walk(handle, world, args.pair_rounds, 0, move)
            compare[move] = {"switches": sws,
                             "hwm_mb": [common.proc_mem_mb(p)["hwm_mb"] for p in walk_pids]}
            handle.stop(timeout=300)
            handle.result(timeout=300)
            handle = None
        return {"world": world, "steady": steady, "switches": switches,
                "steps": len(res.history), "hwm_mb": hwm, "fresh": fresh, "compare": compare}
    finally:
        if handle is not None and not handle.done():
            try:
                handle.stop(timeout=60)
                handle.result(timeout=120)
            except Exception as e:  # report, then tear Ray down regardless
                print(f"[w={world}] stopping the job failed: {e}", flush=True)
        sampler.pids = []
        ray.shutdown()


# ---------------------------------------------------------------------------------- tables


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def steady_table(results: list[dict[str, Any]]) -> str:
    lines = ["| workers | layout | samples/s (window, median of rounds) | per round | "
             "x dp (median of the rounds' ratios) | "
             "median step (ms) | model states per rank (MB: params+grads+optim) | "
             "peak RSS per worker in the long job (MB) | peak RSS per worker, fresh job (MB) | "
             "machine busy cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        by: dict[str, list[dict[str, Any]]] = {}
        for r in res["steady"]:
            by.setdefault(r["layout"], []).append(r)
        dp_by_round = {r["round"]: r["samples_per_s"] for r in by.get("dp", [])}
        fresh = {f["layout"]: f for f in res.get("fresh", [])}
        for lay, rs in by.items():
            fr = fresh.get(lay)
            frss = " / ".join(f"{x:.0f}" for x in fr["hwm_mb"]) if fr else "-"
            thr = [r["samples_per_s"] for r in rs]
            last = rs[-1]
            mem = " / ".join(
                f"{4 * m['params'] / 1e6:.0f}+{4 * m['grads'] / 1e6:.0f}+{4 * m['optim'] / 1e6:.0f}"
                for m in last["memory_elements"])
            rss = " / ".join(f"{max(r['peak_rss_mb'][i] for r in rs):.0f}"
                             for i in range(len(last["peak_rss_mb"])))
            ratios = [r["samples_per_s"] / dp_by_round[r["round"]] for r in rs
                      if dp_by_round.get(r["round"])]
            lines.append(
                f"| {res['world']} | {lay} | {_med(thr):.1f} | "
                f"{', '.join(f'{x:.1f}' for x in thr)} | "
                f"{_med(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)}) | "
                f"{_med([r['median_step_s'] for r in rs]) * 1e3:.0f} | {mem} | {rss} | {frss} | "
                f"{_med([r['machine_cores'] for r in rs]):.2f} |")
    return "\n".join(lines)


def switch_matrix(switches: list[dict[str, Any]]) -> str:
    names = [label(x) for x in layouts()]
    cell: dict[tuple[str, str], list[float]] = {}
    for s in switches:
        cell.setdefault((s["from"], s["to"]), []).append(s["seconds"])
    lines = ["| from \\ to | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for a in names:
        row = []
        for b in names:
            xs = cell.get((a, b))
            row.append("-" if a == b or not xs else f"{_med(xs):.2f}")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def switch_summary(world: int, sw: list[dict[str, Any]], hwm: list[float], move: str) -> str:
    if not sw:
        return "no switches"
    secs = [s["seconds"] for s in sw]
    calls = [s["call_wall_s"] for s in sw]
    first = [s["first_step_s"] for s in sw]
    under = sum(x < 1.0 for x in secs)
    ok = all(s["state_preserved"] for s in sw)
    moved = [s.get("bytes_moved", 0) / 1e6 for s in sw]
    return (f"{move}: {len(sw)} switches on {world} workers: switch event seconds median "
            f"{_med(secs):.2f}, min {min(secs):.2f}, max {max(secs):.2f}; {under}/{len(sw)} "
            f"under 1 s; handle.switch() wall median {_med(calls):.2f}; first step after a "
            f"switch median {_med(first):.2f}s; MB moved between ranks median {_med(moved):.1f}; "
            f"peak RSS per worker (VmHWM) {', '.join(f'{x:.0f}' for x in hwm)} MB; "
            f"state unchanged in all: {ok}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Strategy benchmark: throughput, memory and switch latency per strategy.")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=15, help="measured steps per layout")
    ap.add_argument("--warmup", type=int, default=3, help="steps skipped after each switch")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the layouts")
    ap.add_argument("--pair-rounds", type=int, default=1, help="passes over all 30 pairs")
    ap.add_argument("--fresh-steps", type=int, default=4,
                    help="steps of the short fresh job per layout for peak RSS (0: skip)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="also run bench/_strat_profile.py (phases of a switch, fixes)")
    ap.add_argument("--profile-workers", type=int, default=2)
    ap.add_argument("--compare-moves", nargs="*", default=["reshard", "gather"],
                    help="also walk every pair in a fresh job with these switch_move values")
    ap.add_argument("--layouts", nargs="*", default=[],
                    help="measure only these layouts' throughput (labels: dp zero1 zero2 "
                         "zero3 pipeline-gpipe pipeline-1f1b; dp first); default all")
    ap.add_argument("--model", choices=sorted(common.WORKLOADS), default="mlp",
                    help="the workload: mlp (the ~50 MB MLP) or gpt (elastic.models' TinyGPT, "
                         "0.82M parameters); --profile always profiles the mlp")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    global WORKLOAD
    WORKLOAD = common.WORKLOADS[args.model]
    tmp = common.private_ray_env("rs-")
    import torch

    n = sum(p.numel() for p in WORKLOAD["model"]().parameters())
    print(f"strategies benchmark: model {args.model}, {n / 1e6:.2f}M params "
          f"({n * 4 / 1e6:.1f} MB fp32, Adam), G={G}, micro_batches={MICRO}, "
          f"workers {args.workers}, {args.steps} steps after {args.warmup} warm-up, "
          f"{args.rounds} rounds, {args.pair_rounds} pair rounds; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; code {common.code_version()}; others' load before: {common.busy_cores(2.0):.2f} cores, "
          f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
    sampler = common.Sampler()
    results = []
    t0 = time.time()
    try:
        for w in args.workers:
            results.append(bench_world(w, args, sampler, tmp))
            print(f"[w={w}] done at {time.time() - t0:.0f}s", flush=True)
    finally:
        sampler.stop()
        killed = common.kill_leftovers(tmp)
        if killed:
            print(f"killed {killed} stray Ray processes", flush=True)
    prof = None
    if args.profile:
        from _strat_profile import run as prof_run
        from _strat_profile import summarize

        print(f"\nprofiling _build phases on {args.profile_workers} ranks (outside Ray)...",
              flush=True)
        prof = prof_run(args.profile_workers, 1)
    print(f"\ntotal {time.time() - t0:.0f}s, loadavg now {os.getloadavg()[0]:.1f}\n")
    print(steady_table(results))
    for res in results:
        runs = [("reshard", res["switches"], res["hwm_mb"])] + [
            (m, c["switches"], c["hwm_mb"]) for m, c in res.get("compare", {}).items()]
        for move, sws, hwm in runs:
            print(f"\nswitch latency (s, switch event data['seconds']), {res['world']} workers, "
                  f"switch_move={move}:\n")
            print(switch_matrix(sws))
            print("\n" + switch_summary(res["world"], sws, hwm, move))
    if prof is not None:
        print(f"\n_build phases, {args.profile_workers} ranks, slower rank per switch:\n")
        print(summarize(prof))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "profile": prof}, f, indent=1,
                      default=str)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
