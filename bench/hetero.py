"""Heterogeneity benchmark: speed-proportional batch shares vs equal shares vs the ideal, on
an emulated 4-worker cluster with speeds 1, 1, 0.5, 0.25; and the cost model's predicted
step time of each strategy vs the measured one on the same live workers.

Emulation: ``emulate=[{slowdown: 1}, {slowdown: 1}, {slowdown: 2}, {slowdown: 4}]`` (a worker
sleeps ``slowdown - 1`` times its profiled forward+backward each step). The model
(``bench/_hetero_common.py``) stands for accelerator work: 8 blocks of ``Linear(64, 64)``
whose forward+backward *waits* ~4 ms per sample, so 4 workers on this machine's 2 cores are
not CPU-bound (a real CPU model on 4 single-thread workers would need 2.75 busy cores).

Per round (``--rounds``, all on one private local Ray instance with 4 CPUs):

- **solo**: each emulated device alone, ``num_workers=1`` with its emulation, global batch G
  (the two speed-1 devices are run separately); the **ideal** is the sum of the 4 solo
  throughputs;
- **balanced**: 4 workers, dp, ``balance="on"`` (shares from the profiled speeds);
- **equal**: 4 workers, dp, ``balance="off"`` (G/4 each).

Throughput: G x measured steps / wall time between rank 0's step ends, after ``--warmup``
steps. Goals: balanced >= 97 % of ideal (issue 16), and >= 1.5 x equal.

Two references say where the rest of the ideal goes:

- **alone on its share**: each device alone on the share the balanced run gave it; the
  slowest of them is the balanced step with no synchronisation (the *compute bound*). The
  ideal amortizes each device's per-pass costs (every block's fixed time, the optimizer, the
  data fetch) over all G samples; data parallelism pays them once per step on every device,
  on a quarter of the batch, so the bound is below the ideal by that much;
- **homogeneous, same total speed**: 4 workers of one speed whose sum equals the
  heterogeneous cluster's (slowdown 4 / 2.75 each), equal shares: the gap of balanced to it
  is the cost of heterogeneity itself (HexiScale's measure: 3.5 % published).

Then **predicted vs measured** (``--strategies``): one balanced job switched through dp,
zero1, zero2, zero3 and pipeline (pp 4, gpipe, 4 micro-batches; stages split by speed);
per strategy the median step time over ``--steps`` steps, against ``CostModel.estimate`` of
the same plan (the layout the controller actually applied: its shares / stage split) on
``elastic.planning.live_cluster`` of the live workers, with the model profile
``elastic.planning.model_profile``. Two predictions:

- *profiled*: compute from the controller's profiled samples/s per worker (what
  ``strategy="auto"`` plans with), links and optimizer from the catalog (loopback, CPU);
- *calibrated*: ``clusters.calibrate(..., fit_overhead=True)`` fitted on the dp runs of the
  first part only (solo steps: per-device compute; balanced and equal steps: the critical
  rank's samples plus one gradient all-reduce), then used for every strategy (so zero1-3 and
  pipeline are out-of-sample). Goal: within 15 %.

    python bench/hetero.py --rounds 3 --json /tmp/hetero.json
"""

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

import _hetero_common as hc  # noqa: E402
import _strat_common as common  # noqa: E402

SLOWDOWNS = (1, 1, 2, 4)
G = 128
MICRO = 4


def _cfg(tmp: str, name: str, g: int = G, **kw: Any) -> dict[str, Any]:
    cfg = dict(model=hc.model_factory, optimizer=dict(hc.OPTIM), loss=hc.LOSS,
               dataset=hc.dataset_factory, global_batch_size=g, num_workers=4,
               strategy="dp", view="none", run_dir=os.path.join(tmp, name), name=name,
               seed=hc.SEED, hang_timeout_s=300, micro_batches=MICRO, schedule="gpipe")
    cfg.update(kw)
    return cfg


def _steady(history: list[dict[str, Any]], start: int, n: int, g: int) -> dict[str, float]:
    win = history[start:start + n]
    t0 = history[start - 1]["time"]
    span = win[-1]["time"] - t0
    med = statistics.median(h["step_time"] for h in win)
    return {"samples_per_s": g * len(win) / span, "median_step_s": med,
            "mean_step_s": span / len(win)}


def run_fit(tmp: str, name: str, warmup: int, steps: int, g: int, **kw: Any) -> dict[str, Any]:
    import elastic

    t0 = time.time()
    res = elastic.fit(**_cfg(tmp, name, g, max_steps=warmup + steps, **kw))
    s = _steady(res.history, warmup, steps, g)
    layout = next(e for e in res.events if e.kind == "layout")
    prof = next((e for e in res.events if e.kind == "profiled"), None)
    shares = [int(x) for x in layout.message.split("shares ")[1].split(" (")[0]
              .strip("[]").split(",")]
    return {"name": name, **s, "shares": shares, "wall_s": time.time() - t0,
            "profiled": prof.message if prof else None,
            "step_times": [h["step_time"] for h in res.history]}


def part_balance(tmp: str, args: argparse.Namespace, g: int) -> list[dict[str, Any]]:
    emus = [{"slowdown": k} for k in SLOWDOWNS]
    rounds = []
    for rnd in range(args.rounds):
        busy = common.busy_cores(1.0)
        solo = []
        for i, k in enumerate(SLOWDOWNS):
            r = run_fit(tmp, f"g{g}-solo{i}-x{k}-r{rnd}", args.solo_warmup, args.solo_steps, g,
                        num_workers=1, emulate=[{"slowdown": k}], balance="on")
            r["slowdown"] = k
            solo.append(r)
            print(f"G={g} round {rnd + 1} solo x{k} (device {i}): {r['samples_per_s']:7.1f} samples/s"
                  f" (median step {r['median_step_s'] * 1e3:.0f} ms)", flush=True)
        bal = run_fit(tmp, f"g{g}-balanced-r{rnd}", args.warmup, args.steps, g, emulate=emus,
                      balance="on")
        print(f"G={g} round {rnd + 1} balanced: {bal['samples_per_s']:7.1f} samples/s, shares "
              f"{bal['shares']}, median step {bal['median_step_s'] * 1e3:.0f} ms", flush=True)
        eq = run_fit(tmp, f"g{g}-equal-r{rnd}", args.warmup, args.steps, g, emulate=emus,
                     balance="off")
        print(f"G={g} round {rnd + 1} equal:    {eq['samples_per_s']:7.1f} samples/s, shares "
              f"{eq['shares']}, median step {eq['median_step_s'] * 1e3:.0f} ms", flush=True)
        at_share = _at_share(tmp, args, g, rnd, bal["shares"])
        bound = max(at_share.values())
        homo_k = len(SLOWDOWNS) / sum(1 / k for k in SLOWDOWNS)
        homo = run_fit(tmp, f"g{g}-homogeneous-r{rnd}", args.warmup, args.steps, g,
                       emulate=[{"slowdown": homo_k}] * len(SLOWDOWNS), balance="off")
        print(f"G={g} round {rnd + 1} homogeneous (4 x slowdown {homo_k:.4f}): "
              f"{homo['samples_per_s']:7.1f} samples/s, median step "
              f"{homo['median_step_s'] * 1e3:.0f} ms", flush=True)
        ideal = sum(s["samples_per_s"] for s in solo)
        rounds.append({"g": g, "round": rnd, "solo": solo, "balanced": bal, "equal": eq,
                       "ideal": ideal, "bal_over_ideal": bal["samples_per_s"] / ideal,
                       "bal_over_equal": bal["samples_per_s"] / eq["samples_per_s"],
                       "at_share_s": {f"rank{i}": [n, at_share[(k, n)]] for i, (k, n)
                                      in enumerate(zip(SLOWDOWNS, bal["shares"],
                                                       strict=True))},
                       "compute_bound_s": bound, "bound_over_ideal": g / bound / ideal,
                       "homogeneous": homo, "homogeneous_slowdown": homo_k,
                       "bal_over_homogeneous": bal["samples_per_s"] / homo["samples_per_s"],
                       "busy_before": busy})
        print(f"G={g} round {rnd + 1}: ideal {ideal:.1f}, balanced/ideal "
              f"{rounds[-1]['bal_over_ideal']:.1%} (compute bound at these shares "
              f"{rounds[-1]['bound_over_ideal']:.1%}), balanced/homogeneous "
              f"{rounds[-1]['bal_over_homogeneous']:.1%}, balanced/equal "
              f"{rounds[-1]['bal_over_equal']:.2f}x (others' load before {busy:.2f} cores)",
              flush=True)
    return rounds


def _at_share(tmp: str, args: argparse.Namespace, g: int, rnd: int, shares: list[int]
              ) -> dict[tuple[float, int], float]:
    """Each emulated device alone on the share the balanced run gave it (one run per distinct
    (slowdown, share)): its median step, data fetch and optimizer included. The slowest of
    them bounds the balanced step without any synchronisation; the rest of the balanced step
    is what 4 ranks agreeing costs."""
    out: dict[tuple[float, int], float] = {}
    for k, n in zip(SLOWDOWNS, shares, strict=True):
        if (k, n) in out:
            continue
        r = run_fit(tmp, f"g{g}-share{n}-x{k}-r{rnd}", args.solo_warmup, args.solo_steps, n,
                    num_workers=1, emulate=[{"slowdown": k}], balance="on")
        out[(k, n)] = r["median_step_s"]
        print(f"G={g} round {rnd + 1} x{k} alone on its share {n}: median step "
              f"{r['median_step_s'] * 1e3:.1f} ms", flush=True)
    return out


# ---------------------------------------------------------------------------------- cost model


def _plan_for(spec: Any, ids: list[str]) -> Any:
    from clusters import Plan

    if spec.name == "pipeline":
        from strategies.blocks import pipeline_blocks
        from strategies.pipeline import _resolve_split

        split = spec.stage_split or _resolve_split(spec, pipeline_blocks(hc.model_factory()))
        d = spec.world_size // spec.pp_degree
        reps = [sum(spec.shares[j::d]) for j in range(d)]
        return Plan(strategy="pipeline", world_size=spec.world_size, shares=tuple(reps),
                    pp_degree=spec.pp_degree, micro_batches=spec.micro_batches,
                    schedule=spec.schedule, stage_split=tuple(split), devices=tuple(ids))
    return Plan(strategy=spec.name, world_size=spec.world_size, shares=tuple(spec.shares),
                devices=tuple(ids))


def part_strategies(tmp: str, args: argparse.Namespace, balance_rounds: list[dict[str, Any]],
                    g: int) -> dict[str, Any]:
    import elastic
    from clusters import CostModel, Measurement, calibrate
    from elastic.planning import live_cluster, model_profile

    emus = [{"slowdown": k} for k in SLOWDOWNS]
    # strategy="auto": the job profiles every worker and times all-reduces between them (the
    # "links" event), exactly what the planner predicts with; then it is switched through
    handle = elastic.submit(**_cfg(tmp, "strategies", g, max_steps=10_000_000, emulate=emus,
                                   balance="on", strategy="auto", replan_every=0))
    out: dict[str, Any] = {"rows": []}
    try:
        ctl = handle.controller
        t0 = time.time()
        while len(ctl.history) < 1:
            if handle.done():
                handle.result()
            if time.time() - t0 > 600:
                raise TimeoutError("no step")
            time.sleep(0.05)
        infos = [dict(w.info, rank=w.rank) for w in ctl.workers]
        speeds = [ctl.layouts.speed[w.worker_id] for w in ctl.workers]
        cluster, ids = live_cluster(infos)
        profile = model_profile(ctl.layouts.probe_model, hc.OPTIM)
        measured: dict[str, dict[str, Any]] = {}
        for name in args.strategies:
            if name != ctl.spec.name:
                handle.switch(name, reason="bench", timeout=300)
            ev_step = ctl.step
            spec = ctl.spec
            start = ev_step + args.warmup
            while len(ctl.history) < start + args.steps:
                if handle.done():
                    handle.result()
                time.sleep(0.05)
            hist = list(ctl.history)
            win = hist[start:start + args.steps]
            assert all(h["strategy"] == name for h in win), (name, win[0])
            med = statistics.median(h["step_time"] for h in win)
            measured[name] = {"spec": spec, "median_step_s": med,
                              "step_times": [h["step_time"] for h in win]}
            print(f"strategy {name:9s} shares {list(spec.shares)} split {spec.stage_split} "
                  f"median step {med * 1e3:.1f} ms", flush=True)
        out["speeds"] = speeds
        out["ids"] = ids
        mm = ctl.layouts.measured  # what strategy="auto" planned with (every term measured)
    finally:
        handle.stop(timeout=300)
        handle.result(timeout=300)

    # profiled: the cost model the live planner used (elastic/worker/measure.py's terms)
    prof_model = mm.model
    profile = mm.profile
    out["profiled_collectives"] = {k: list(v) for k, v in prof_model.collectives.items()}
    out["profiled_step_overhead"] = prof_model.step_overhead
    # calibrated on the dp runs of part 1 (solo + balanced + equal), medians over rounds
    meas = []
    dev_of = {k: [ids[r] for r, kk in enumerate(SLOWDOWNS) if kk == k] for k in set(SLOWDOWNS)}
    grad_bytes = 4 * hc.n_params()
    for rnd in balance_rounds:
        for s in rnd["solo"]:
            for dev in dev_of[s["slowdown"]]:
                meas.append(Measurement(device=dev, samples=g, step_time=s["median_step_s"]))
        for key in ("balanced", "equal"):
            r = rnd[key]
            crit = max(range(4), key=lambda i: r["shares"][i] * SLOWDOWNS[i])
            meas.append(Measurement(device=ids[crit], samples=r["shares"][crit],
                                    step_time=r["median_step_s"], world_size=4,
                                    comm_bytes=grad_bytes, collective="all_reduce"))
    cal_model = calibrate(meas, base=CostModel(), fit_overhead=True)
    out["calibrated"] = {"seconds_per_sample": dict(cal_model.seconds_per_sample),
                         "links": {k: list(v) for k, v in cal_model.links.items()},
                         "step_overhead": cal_model.step_overhead}
    for name in args.strategies:
        m = measured[name]
        plan = _plan_for(m["spec"], ids)
        p1 = prof_model.estimate(plan, cluster, profile)
        p2 = cal_model.estimate(plan, cluster, profile)
        row = {"strategy": name, "plan": plan.label, "shares": list(m["spec"].shares),
               "stage_split": m["spec"].stage_split, "measured_s": m["median_step_s"],
               "profiled_s": p1.step_time, "calibrated_s": p2.step_time,
               "profiled_err": p1.step_time / m["median_step_s"] - 1,
               "calibrated_err": p2.step_time / m["median_step_s"] - 1,
               "calibrated_parts": {"compute": p2.compute, "comm": p2.comm,
                                    "optimizer": p2.optimizer, "bubble": p2.bubble},
               "step_times": m["step_times"]}
        out["rows"].append(row)
    # profiled + the job's own per-step overhead: what the model leaves out (control,
    # optimizer bookkeeping, the wait for the slowest rank's jitter) measured on the first
    # layout the job ran (dp: measured - predicted), then added to every other prediction
    first = out["rows"][0] if out["rows"] else None
    over = max(0.0, first["measured_s"] - first["profiled_s"]) if first else 0.0
    out["live_overhead_s"] = over
    for row in out["rows"]:
        row["live_s"] = row["profiled_s"] + over
        row["live_err"] = row["live_s"] / row["measured_s"] - 1
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def balance_table(rounds: list[dict[str, Any]]) -> str:
    g = rounds[0]["g"]
    lines = [f"G = {g}:", "", "| configuration | samples/s (median of rounds) | per round | "
             "shares | median step (ms) |", "|---|---|---|---|---|"]
    for i, k in enumerate(SLOWDOWNS):
        xs = [r["solo"][i]["samples_per_s"] for r in rounds]
        st = [r["solo"][i]["median_step_s"] * 1e3 for r in rounds]
        lines.append(f"| solo device {i} (speed {1 / k:g}) | {_med(xs):.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in xs)} | {g} | {_med(st):.0f} |")
    ideal = [r["ideal"] for r in rounds]
    lines.append(f"| ideal (sum of solos) | {_med(ideal):.1f} | "
                 f"{', '.join(f'{x:.1f}' for x in ideal)} | - | - |")
    for key, lab in (("balanced", 'balanced (balance="on")'), ("equal", 'equal (balance="off")')):
        xs = [r[key]["samples_per_s"] for r in rounds]
        st = [r[key]["median_step_s"] * 1e3 for r in rounds]
        shares = "; ".join(str(r[key]["shares"]) for r in rounds)
        lines.append(f"| {lab} | {_med(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} | "
                     f"{shares} | {_med(st):.0f} |")
    if all("homogeneous" in r for r in rounds):
        xs = [r["homogeneous"]["samples_per_s"] for r in rounds]
        st = [r["homogeneous"]["median_step_s"] * 1e3 for r in rounds]
        lines.append(f"| homogeneous, same total speed (4 x slowdown "
                     f"{rounds[0]['homogeneous_slowdown']:.4f}, equal shares) | {_med(xs):.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in xs)} | {g // 4} each | {_med(st):.0f} |")
        for i, k in enumerate(SLOWDOWNS):
            got = [r["at_share_s"][f"rank{i}"] for r in rounds]
            lines.append(f"| device {i} (speed {1 / k:g}) alone on its balanced share | - | - "
                         f"| {'; '.join(str(n) for n, _ in got)} | "
                         f"{_med([t * 1e3 for _, t in got]):.1f} |")
    bi = [r["bal_over_ideal"] for r in rounds]
    be = [r["bal_over_equal"] for r in rounds]
    lines += [""]
    if all("homogeneous" in r for r in rounds):
        bh = [r["bal_over_homogeneous"] for r in rounds]
        bb = [r["bound_over_ideal"] for r in rounds]
        lines += [f"balanced / homogeneous of the same total speed: median {_med(bh):.1%} "
                  f"(per round {', '.join(f'{x:.1%}' for x in bh)})",
                  f"compute bound at the balanced shares (the slowest device alone on its "
                  f"share) / ideal: median {_med(bb):.1%} (per round "
                  f"{', '.join(f'{x:.1%}' for x in bb)})"]
    lines += [f"balanced / ideal: median {_med(bi):.1%} (per round "
              f"{', '.join(f'{x:.1%}' for x in bi)}); goal (issue 16) >= 97%",
              f"balanced / equal: median {_med(be):.2f}x (per round "
              f"{', '.join(f'{x:.2f}' for x in be)}); goal >= 1.5x"]
    return "\n".join(lines)


def tables(by_g: dict[int, list[dict[str, Any]]], strat: dict[str, Any] | None) -> str:
    lines = [balance_table(rs) + "\n" for rs in by_g.values()]
    if strat:
        lines += ["", "| strategy | plan | measured median step (ms) | predicted, profiled (ms) "
                  "| error | profiled + live overhead (ms) | error "
                  "| predicted, calibrated (ms) | error | calibrated parts (compute / "
                  "comm / optimizer ms, bubble) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in strat["rows"]:
            p = r["calibrated_parts"]
            lines.append(
                f"| {r['strategy']} | {r['plan']} | {r['measured_s'] * 1e3:.1f} | "
                f"{r['profiled_s'] * 1e3:.1f} | {r['profiled_err']:+.0%} | "
                f"{r['live_s'] * 1e3:.1f} | {r['live_err']:+.0%} | "
                f"{r['calibrated_s'] * 1e3:.1f} | {r['calibrated_err']:+.0%} | "
                f"{p['compute'] * 1e3:.1f} / {p['comm'] * 1e3:.1f} / {p['optimizer'] * 1e3:.2f}, "
                f"{p['bubble']:.2f} |")
        c = strat["calibrated"]
        lines += ["", f"live overhead (fitted on the job's first layout, "
                  f"{strat['rows'][0]['strategy']}): {strat['live_overhead_s'] * 1e3:.1f} ms",
                  f"profiled links (alpha s, beta s/byte): {strat.get('profiled_links')}"]
        lines += ["", f"profiled speeds (samples/s): "
                  f"{', '.join(f'{s:.0f}' for s in strat['speeds'])}",
                  f"calibrated: seconds/sample {c['seconds_per_sample']}, links {c['links']}, "
                  f"step overhead {c['step_overhead'] * 1e3:.2f} ms"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="measured steps, 4-worker runs")
    ap.add_argument("--solo-steps", type=int, default=6, help="measured steps, solo runs")
    ap.add_argument("--solo-warmup", type=int, default=2)
    ap.add_argument("--global-batch", type=int, nargs="+", default=[G, 2 * G],
                    help="global batch sizes of the balance part (the first also for the "
                         "strategies part)")
    ap.add_argument("--strategies", nargs="*",
                    default=["dp", "zero1", "zero2", "zero3", "pipeline"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tmp = common.private_ray_env("rh-")
    import ray

    print(f"hetero benchmark: slowdowns {SLOWDOWNS}, G={args.global_batch}, model {hc.n_params()} params, "
          f"~{hc.MS_PER_SAMPLE} ms/sample (waiting), {args.rounds} rounds; code "
          f"{common.code_version()}; others' load "
          f"before: {common.busy_cores(2.0):.2f} cores, loadavg {os.getloadavg()[0]:.1f}",
          flush=True)
    t0 = time.time()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        by_g = {g: part_balance(tmp, args, g) for g in args.global_batch}
        g0 = args.global_batch[0]
        strat = part_strategies(tmp, args, by_g[g0], g0) if args.strategies else None
    finally:
        ray.shutdown()
        killed = common.kill_leftovers(tmp)
        if killed:
            print(f"killed {killed} stray Ray processes", flush=True)
    print(f"\ntotal {time.time() - t0:.0f}s, loadavg now {os.getloadavg()[0]:.1f}\n")
    print(tables(by_g, strat))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": by_g, "strategies": strat}, f, indent=1,
                      default=str)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
