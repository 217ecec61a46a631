"""Planner benchmark (issue 16 point 6): does ``strategy: auto`` pick the fastest plan, and how
close is the cost model it plans with to the measured step time?

Per configuration (a model family of ``bench/_planner_models.py`` x a world size), one live
job (``elastic.submit``, ``strategy="auto"``, the closed loop off so that the bench decides
what runs):

1. **profiled** (before any training step): the workers' ``profile_terms`` (every term
   repeated, the noise reported) and the planner's choice, the *pick*;
2. the pick runs ``--first`` steps (the closed loop's window), then the job is switched through
   dp, zero1, zero2, zero3 and a pipeline (pp = world, 1F1B, 4 micro-batches by default
   (``--micro-batches``), stages cut by the measured per-block times), each for ``--warmup``
   + ``--steps`` steps, and back through the same layouts in reverse (``--passes 2``, the default): each layout's figure pools both
   passes, so a drift of the machine over the run cancels to first order instead of favouring
   whichever layout ran in its quiet moment, and the table applies the goals' yardsticks to
   pass 1 against pass 2, the measurement against itself (``_planner_noise.py``;
   ``--passes 4``: there and back twice, passes 1 + 4 against 2 + 3; ``--passes 1``: one pass, then dp once more, as before
   2026-12-04);
3. per layout: the measured median step and its spread, the profiled prediction of that exact
   layout (``CostModel.estimate`` of ``elastic.planning.spec_plan`` of the spec that ran, on
   the model the job planned with), and the **closed-loop** prediction: the profiled model
   re-fitted (``clusters.refit``) to the pick's first 50 steps only, so every other layout is
   out of sample; the pick's own figure after the loop is its measured median.

Goals (issue 16): profiled within 10 % for every layout; closed loop within 5 %; the pick
within 5 % of the measured fastest in >= 90 % of the configurations. The machine is shared:
each figure is also given as a ratio to dp measured in the same run.

    python bench/planner.py --json /tmp/planner.json
    python bench/planner.py --families mlp mixer --workers 2
    python bench/planner.py --tables /tmp/a.json /tmp/b.json   # runs printed as one table
    python bench/planner.py --tables /tmp/a.json --replay   # predicted again by this code

Each run's JSON keeps the workers' profile reports (``profile``): ``--replay`` fits the model
from them again with the code as it is now and re-predicts every row and the pick, against
the run's own measured steps, so a change to the cost model, its fit or the ranking is judged
on every stored run at once (not a change to what the profiler measures: that needs new runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _planner_models as pm  # noqa: E402
import _planner_noise as noise  # noqa: E402
import _strat_common as common  # noqa: E402

LAYOUTS = noise.LAYOUTS


def _wait_steps(handle: Any, ctl: Any, n: int, timeout_s: float = 900.0) -> None:
    t0 = time.time()
    while len(ctl.history) < n:
        if handle.done():
            handle.result()
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"{n} steps not reached in {timeout_s:.0f} s")
        time.sleep(0.05)


def _segment(ctl: Any, start: int, n: int) -> list[float]:
    hist = list(ctl.history)[start:start + n]
    return [h["step_time"] for h in hist]


def run_loop(tmp: str, fam: pm.Family, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """A second ``auto`` job of the configuration with the closed loop on (``--loop-every``),
    long as a real job is (its remaining steps make a try pay), stopped after
    ``--loop-steps``: the layouts it ran, in order, each with its steps and median, and the
    ``replan`` decisions that were not to keep the layout."""
    import elastic
    from clusters.measured import robust
    from elastic.planning import spec_plan

    name = f"{fam.name}-w{world}-loop"
    handle = elastic.submit(
        model=fam.model, optimizer={"name": "adam", "lr": 1e-3}, loss=fam.loss,
        dataset=fam.dataset, global_batch_size=fam.global_batch, num_workers=world,
        strategy="auto", view="none", run_dir=os.path.join(tmp, name), name=name,
        max_steps=10_000_000, replan_every=args.loop_every, pp_degree=world,
        micro_batches=args.micro_batches, schedule="1f1b", hang_timeout_s=300)
    ctl = handle.controller
    try:
        _wait_steps(handle, ctl, args.loop_steps)
        hist = list(ctl.history)[:args.loop_steps]
        segs: list[dict[str, Any]] = []
        for h in hist:
            if not segs or segs[-1]["strategy"] != h["strategy"]:
                segs.append({"strategy": h["strategy"], "start": h["step"], "times": []})
            segs[-1]["times"].append(h["step_time"])
        for sg in segs:
            st = robust(sg.pop("times")[2:] or [0.0])
            sg.update(steps=st.n + 2, median_s=st.median)
        final = spec_plan(ctl.spec, list(ctl.layouts.ids), ctl.layouts.probe_model).label
        decisions = [{"step": e.step, "decision": e.data.get("decision"), "why": e.message}
                     for e in ctl.events if e.kind == "replan"
                     and e.data.get("decision") != "KeepPlan"]
    finally:
        handle.stop(timeout=300)
        try:
            handle.result(timeout=300)
        except Exception as e:  # noqa: BLE001 - report, go on
            print(f"  {name}: the job ended with {type(e).__name__}: {e}", flush=True)
    print(f"  {name}: " + " -> ".join(f"{sg['strategy']} ({sg['steps']} steps, "
                                      f"{sg['median_s'] * 1e3:.1f} ms)" for sg in segs)
          + f"; settled on {final}", flush=True)
    for d in decisions:
        print(f"    step {d['step']}: {d['why'][:160]}", flush=True)
    return {"segments": segs, "final": final, "decisions": decisions}


def run_config(tmp: str, fam: pm.Family, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import elastic
    from clusters.measured import robust
    from elastic.planning import spec_plan

    name = f"{fam.name}-w{world}"
    handle = elastic.submit(
        model=fam.model, optimizer={"name": "adam", "lr": 1e-3}, loss=fam.loss,
        dataset=fam.dataset, global_batch_size=fam.global_batch, num_workers=world,
        strategy="auto", view="none", run_dir=os.path.join(tmp, name), name=name,
        max_steps=10_000_000, replan_every=0, pp_degree=world,
        micro_batches=args.micro_batches, schedule="1f1b", hang_timeout_s=300)
    ctl = handle.controller
    rows: dict[str, dict[str, Any]] = {}
    try:
        _wait_steps(handle, ctl, 1)
        lay = ctl.layouts
        mm, cluster, ids = lay.measured, lay.cluster, list(lay.ids)
        profiled = lay.profiled
        optimizer, precision = ctl.cfg.optimizer, ctl.cfg.precision
        plan_ev = next(e for e in ctl.events if e.kind == "plan")
        pick = ctl.spec
        seg = args.warmup + args.steps
        # there and back: a drift of the machine cancels to first order
        order = [("pick", pick.name, args.first)] + [
            (n, "dp" if n == "dp-again" else n, seg) for n in noise.pass_order(args.passes)]
        runs: dict[str, list[list[float]]] = {}
        for key, strat, n_steps in order:
            if key in runs and not runs[key]:
                continue  # refused on the way there
            switch = key != "pick" and ctl.spec.name != strat  # not at the turn
            if switch:
                try:
                    handle.switch(strat, reason="bench", timeout=600)
                except Exception as e:  # noqa: BLE001 - a layout this model cannot run
                    print(f"  {name} {key}: not run ({type(e).__name__}: {e})", flush=True)
                    runs[key] = []
                    continue
            # a switch's (or the job's first) boundary; at the turn, the steps from here on
            start = ctl.step if switch or key == "pick" else len(ctl.history)
            spec = ctl.spec
            _wait_steps(handle, ctl, start + n_steps)
            skip = 2 if key == "pick" else args.warmup
            times = _segment(ctl, start + skip, n_steps - skip)
            assert all(h["strategy"] == spec.name
                       for h in list(ctl.history)[start:start + n_steps]), key
            runs.setdefault(key, []).append(times)
            if key in rows:
                continue
            plan = spec_plan(spec, ids, lay.probe_model)
            est = mm.model.estimate(plan, cluster, mm.profile)
            rows[key] = {"strategy": spec.name, "plan": plan.label, "shares": list(spec.shares),
                         "spec": _spec_dict(spec),
                         "split": list(plan.stage_split), "profiled_s": est.step_time,
                         "parts": {"compute": est.compute, "comm": est.comm,
                                   "optimizer": est.optimizer}, "plan_obj": plan}
            if plan.is_pipeline:  # and as the model predicted it before a pipeline trial
                bare = replace(mm.model, pipe_action_s=0.0, pipe_bubble_scale=1.0,
                               pipe_msg_scale=1.0, pipe_step_overhead=None,
                               pipe_update_scale=1.0)
                rows[key]["untrialed_s"] = bare.estimate(plan, cluster, mm.profile).step_time
        for key, r in rows.items():  # the passes pooled; each pass's median kept
            st = robust([t for ts in runs[key] for t in ts])
            r.update(measured_s=st.median, sd_s=st.sd, n=st.n, times=runs[key][0],
                     passes=[robust(ts).median for ts in runs[key]], pass_times=runs[key])
            print(f"  {name} {key:9s} {r['plan']:22s} measured {st.median * 1e3:7.1f} ms "
                  f"(sd {st.sd * 1e3:5.1f}; passes "
                  f"{', '.join(f'{m * 1e3:.1f}' for m in r['passes'])}) profiled "
                  f"{r['profiled_s'] * 1e3:7.1f} ms", flush=True)
    finally:
        handle.stop(timeout=300)
        try:
            handle.result(timeout=300)
        except Exception as e:  # noqa: BLE001 - report, go on with the next configuration
            print(f"  {name}: the job ended with {type(e).__name__}: {e}", flush=True)
    first = rows["pick"]
    fitted = _predict(rows, {k: r.pop("plan_obj") for k, r in rows.items()}, mm, cluster)
    # the pick against the fastest, like with like: every layout's row is measured the same
    # way (after a switch, back to back); the pick's own first 50 steps (the job's start) are
    # that row when the pick is one of them, and otherwise stand for it
    measured = [k for k in LAYOUTS if k in rows]
    same = noise.passes_row(rows, first["plan"])
    cands = measured if same is not None else measured + ["pick"]
    fastest = min(cands, key=lambda k: rows[k]["measured_s"])
    pick_s = (same or first)["measured_s"]
    return {"config": name, "family": fam.name, "world": world, "rows": rows,
            "pick": first["plan"], "fastest": rows[fastest]["plan"],
            "pick_over_fastest": pick_s / rows[fastest]["measured_s"],
            "pick_segment_over_fastest": first["measured_s"] / rows[fastest]["measured_s"],
            "plan_event": plan_ev.message, "speeds": list(mm.speeds),
            "profile_s": plan_ev.data.get("profile_s"), "plan_s": plan_ev.data.get("plan_s"),
            "profile_phases": plan_ev.data.get("profile_phases", {}),
            "raw_speeds": list(mm.raw_speeds), "spreads": mm.spreads,
            "step_overhead_s": mm.model.step_overhead, "overlap": mm.model.overlap,
            "loop_overhead_s": fitted.step_overhead, "loop_comm_scale": dict(fitted.comm_scale),
            # what the model was fitted from, for ``--replay``
            "profile": {"infos": _shareable(profiled[0]), "reports": profiled[1],
                        "optimizer": optimizer, "precision": precision}}


def _predict(rows: dict[str, dict[str, Any]], plans: dict[str, Any], mm: Any,
             cluster: Any) -> Any:
    """Each row's ``profiled_s`` (the profiled model's estimate of its plan) and ``loop_s``:
    the closed loop's, the profiled model re-fitted (``clusters.refit``) to the pick's first
    50 steps only (the pick's own: their median). Returns the re-fitted model."""
    from clusters.measured import robust
    from clusters.refit import Observed, refit

    seen = robust(rows["pick"]["times"][:50])
    fitted = refit(mm.model, mm.profile, cluster, [Observed(plans["pick"], seen)])
    for k, r in rows.items():
        r["profiled_s"] = mm.model.estimate(plans[k], cluster, mm.profile).step_time
        r["loop_s"] = (seen.median if k == "pick"
                       else fitted.estimate(plans[k], cluster, mm.profile).step_time)
    return fitted


def _shareable(infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers' infos without what names the machine (its address, process ids): a
    hostname becomes ``host-<n>``, the same for the same host, which is all the planner
    reads of it (``planning.device_hosts``)."""
    names: dict[Any, str] = {}
    out = []
    for i in infos:
        i = {k: v for k, v in i.items() if k not in ("ip", "pid")}
        if "hostname" in i:
            i["hostname"] = names.setdefault(i["hostname"], f"host-{len(names)}")
        out.append(i)
    return out


def _load(path: str) -> dict[str, Any]:
    import gzip
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def _spec_dict(spec: Any) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(spec)


def _spec_from(d: dict[str, Any]) -> Any:
    from strategies import StrategySpec
    from strategies.spec import StrategyOptions
    kw = dict(d)
    kw["shares"] = tuple(kw["shares"])
    if kw.get("stage_split") is not None:
        kw["stage_split"] = tuple(kw["stage_split"])
    options = StrategyOptions(**kw.pop("options"))
    return StrategySpec(**kw, options=options)


def replay(results: list[dict[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """The runs' predictions made again by the code as it is now, from the profile reports
    each run kept (``profile``): every row's profiled and closed-loop figure, and auto's pick
    (``pick_over_fastest``: the run's own for the same pick; for another, where the passes
    measured its plan, else the configuration is left out of the pick count). The measured
    side is the runs' own: a change to the cost model or the fit is judged on every stored
    run at once, without the host's noise of a new one. Runs without reports (before
    2026-12-06) are skipped; a loop job's figures (``--loop-steps``) are the run's own.
    ``options`` go to the planner (``auto_plan``), for a what-if (``planner_whatif.py``)."""
    import torch

    from elastic.planning import auto_plan, measured_model, spec_plan

    out = []
    for res in results:
        prof = res.get("profile")
        if not prof:
            print(f"  {res['config']}: no profile reports kept; skipped", flush=True)
            continue
        fam = pm.ALL[res["family"]]
        torch.manual_seed(0)
        model = fam.model()
        cluster, mm = measured_model(model, prof["optimizer"], prof["infos"], prof["reports"],
                                     prof["precision"])
        ids = [d.id for d in cluster.devices]
        rows = {k: {f: v for f, v in r.items() if f != "untrialed_s"}  # not made again
                for k, r in res["rows"].items()}
        _predict(rows, {k: spec_plan(_spec_from(r["spec"]), ids, model)
                        for k, r in rows.items()}, mm, cluster)
        pick = auto_plan(cluster, mm, fam.global_batch, **options).plan.label
        new = {**res, "rows": rows, "pick": pick, "speeds": list(mm.speeds),
               "raw_speeds": list(mm.raw_speeds), "step_overhead_s": mm.model.step_overhead,
               "overlap": mm.model.overlap}
        if pick != res["pick"]:  # (the same pick keeps the run's figures: its first 50
            # steps stand for it where the passes did not run its plan)
            ran = noise.passes_row(rows, pick)
            new["pick_over_fastest"] = new["pick_segment_over_fastest"] = (
                None if ran is None else ran["measured_s"] / _fastest_row(res)["measured_s"])
        out.append(new)
    return out


def _settled(res: dict[str, Any]) -> float | None:
    """The loop job's last layout over the fastest, each as the passes measured it (None: no
    loop, or it settled on a plan the passes did not run)."""
    loop = res.get("loop")
    rows = res["rows"]
    if not loop:
        return None
    row = noise.passes_row(rows, loop["final"])
    return None if row is None else row["measured_s"] / _fastest_row(res)["measured_s"]


def _fastest_row(res: dict[str, Any]) -> dict[str, Any]:
    """The measured fastest plan's row: the passes' (not the pick's first 50 steps, where the
    pick is that plan too), or the pick's where the passes did not run its plan."""
    return noise.passes_row(res["rows"], res["fastest"]) or res["rows"]["pick"]


def _loop_cell(res: dict[str, Any]) -> str:
    loop = res.get("loop")
    if not loop:
        return "-"
    ran = " > ".join(f"{sg['strategy']} {sg['steps']}" for sg in loop["segments"])
    ratio = _settled(res)
    return f"{ran}; {loop['final']}, " + (f"{ratio:.3f}" if ratio is not None else "not in the passes")


def _startup(res: dict[str, Any]) -> str:
    """What auto spent before its first step: the profile (trial steps included) + the plan."""
    if res.get("profile_s") is None:
        return "-"  # a result from before session 31
    return f"{res['profile_s']:.1f} + {res['plan_s']:.2f}"


def _ratio(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.3f}"


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| config | layout | plan | measured ms (sd) | / dp | profiled ms | error | / dp "
             "predicted | after loop ms | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    errs_p, errs_l, picks, drift = [], [], [], []
    settled: list[bool] = []
    ratios_p: list[float] = []
    ratios_l: list[float] = []
    for res in results:
        rows = res["rows"]
        ref = rows.get("dp") or rows["pick"]
        dp_m, dp_p = ref["measured_s"], ref["profiled_s"]
        for key in ("pick", *LAYOUTS, "dp-again"):
            if key not in rows:
                continue
            r = rows[key]
            ep = r["profiled_s"] / r["measured_s"] - 1
            el = r["loop_s"] / r["measured_s"] - 1
            if key in LAYOUTS:
                errs_p.append(abs(ep))
                if r["plan"] != rows["pick"]["plan"]:
                    errs_l.append(abs(el))
                if key != "dp" and "dp" in rows:  # as ratios to dp, measured in the same passes
                    ratio = r["measured_s"] / dp_m
                    ratios_p.append(abs(r["profiled_s"] / dp_p / ratio - 1))
                    if r["plan"] != rows["pick"]["plan"]:
                        ratios_l.append(abs(r["loop_s"] / rows["dp"]["loop_s"] / ratio - 1))
            lines.append(
                f"| {res['config']} | {key} | {r['plan']} | {r['measured_s'] * 1e3:.1f} "
                f"({r['sd_s'] * 1e3:.1f}) | {r['measured_s'] / dp_m:.2f} | "
                f"{r['profiled_s'] * 1e3:.1f} | {_pct(ep)} | {r['profiled_s'] / dp_p:.2f} | "
                f"{r['loop_s'] * 1e3:.1f} | {_pct(el)} |")
            if "untrialed_s" in r:
                lines.append(f"| {res['config']} | {key}, no pipeline trial | {r['plan']} | | | "
                             f"{r['untrialed_s'] * 1e3:.1f} | "
                             f"{_pct(r['untrialed_s'] / r['measured_s'] - 1)} | | | |")
        if res["pick_over_fastest"] is not None:
            picks.append(res["pick_over_fastest"] <= 1.05)
        if _settled(res) is not None:
            settled.append(_settled(res) <= 1.05)
        if "dp" in rows and "dp-again" in rows:
            drift.append(abs(rows["dp-again"]["measured_s"] / rows["dp"]["measured_s"] - 1))
    lines += ["", "| config | pick (auto) | measured fastest | pick / fastest (its row; its "
              "first 50 steps) | speeds (equalized; raw) | trial overhead ms | overlap | "
              "profile + plan s | loop: layouts run; settled / fastest |",
              "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        lines.append(
            f"| {res['config']} | {res['pick']} | {res['fastest']} | "
            f"{_ratio(res['pick_over_fastest'])}; "
            f"{_ratio(res.get('pick_segment_over_fastest', res['pick_over_fastest']))} | "
            f"{', '.join(f'{s:.0f}' for s in res['speeds'])}; "
            f"{', '.join(f'{s:.0f}' for s in res['raw_speeds'])} | "
            f"{res['step_overhead_s'] * 1e3:.1f} | {res['overlap']:.2f} | "
            f"{_startup(res)} | {_loop_cell(res)} |")
    if errs_p:
        lines += ["", f"profiled: {sum(e <= 0.10 for e in errs_p)}/{len(errs_p)} layouts within "
                  f"10 % (median |error| {statistics.median(errs_p):.0%}, max "
                  f"{max(errs_p):.0%})",
                  f"closed loop (out of sample): {sum(e <= 0.05 for e in errs_l)}/{len(errs_l)} "
                  f"within 5 % (median |error| {statistics.median(errs_l) if errs_l else 0:.0%})",
                  f"pick within 5 % of the fastest: {sum(picks)}/{len(picks)} configurations"
                  + (f" ({len(results) - len(picks)} left out: a replayed pick the passes did "
                     "not run)" if len(picks) < len(results) else "")]
        if settled:
            lines.append(f"closed loop on (its own job): settled within 5 % of the fastest: "
                         f"{sum(settled)}/{len(settled)} configurations")
    if ratios_p:  # the host's slow phases come and go (1.3-2x for 10-40 steps on the CI VM):
        # each layout as a ratio to dp measured in the same passes, against the same ratio
        # predicted, leaves out the level of the phase each was measured in
        lines += [f"as ratios to dp (same passes): profiled {sum(e <= 0.10 for e in ratios_p)}/"
                  f"{len(ratios_p)} within 10 % (median {statistics.median(ratios_p):.0%}); "
                  f"closed loop {sum(e <= 0.05 for e in ratios_l)}/{len(ratios_l)} within 5 % "
                  f"(median {statistics.median(ratios_l) if ratios_l else 0:.0%})"]
    if drift:
        lines.append(f"noise: dp measured twice in one run (dp, dp-again) differs by a median "
                     f"{statistics.median(drift):.0%} (max {max(drift):.0%})")
    lines += noise.repeatability(results)
    phased = [r for r in results if r.get("profile_phases")]
    if phased:  # where auto's start goes (each part's most over the ranks)
        names = list(phased[0]["profile_phases"])
        lines += ["", "| config | profile s | " + " | ".join(names) + " | plan s |",
                  "|---|---|" + "---|" * len(names) + "---|"]
        lines += [f"| {r['config']} | {r['profile_s']:.1f} | " + " | ".join(
            f"{r['profile_phases'].get(n, 0.0):.1f}" for n in names) + f" | {r['plan_s']:.2f} |"
            for r in phased]
    return "\n".join(lines)


def _dump(args: argparse.Namespace, commit: str, results: list[dict[str, Any]]) -> None:
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "commit": commit, "results": results}, f, indent=1,
                  default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(pm.FAMILIES), choices=list(pm.ALL),
                    help="default: the five tuned on; also the held-out resnet, lstm, bow (session 33) and vit, autoenc, wide (session 35)")
    ap.add_argument("--workers", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--first", type=int, default=52, help="steps of the pick (2 warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--passes", type=int, choices=noise.PASSES, default=2,
                    help="2: every layout there and back (dp .. pipeline, pipeline .. dp), "
                         "pooled; 4: there and back twice, and the table says how far "
                         "passes 1 + 4 agree with 2 + 3 (_planner_noise.py); 1: once, then dp "
                         "again")
    ap.add_argument("--micro-batches", type=int, default=4,
                    help="the pipeline row's (the profiler's pipeline trial runs the fewest "
                    ">= world that divide the batch and the most that divide it from twice to 4 "
                    "times that: 4 and 16 at 3 workers, 2 and 8 at 2, for G = 64)")
    ap.add_argument("--loop-steps", type=int, default=0,
                    help="then a second auto job with the closed loop on, this many steps: "
                    "where it settles against the fastest the passes measured (0: not run)")
    ap.add_argument("--loop-every", type=int, default=25, help="its replan_every")
    ap.add_argument("--json")
    ap.add_argument("--tables", nargs="+", metavar="JSON",
                    help="print the tables of earlier runs' --json files together, run nothing")
    ap.add_argument("--replay", action="store_true",
                    help="with --tables: the predictions made again by this code from the "
                    "profile reports the runs kept (``replay``), the measured side as it was")
    args = ap.parse_args(argv)
    if args.tables:
        merged = []
        for path in args.tables:
            d = _load(path)
            print(f"{path}: code {d['commit']}", flush=True)
            merged += d["results"]
        print(table(replay(merged) if args.replay else merged))
        return 0
    tmp = common.private_ray_env("rpl-")
    import ray

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"planner benchmark: families {args.families}, workers {args.workers}; code "
          f"{commit} ({common.code_version()}); others' load before: "
          f"{common.busy_cores(2.0):.2f} cores, loadavg {os.getloadavg()[0]:.1f}", flush=True)
    t0 = time.time()
    ray.init(address="local", num_cpus=max(args.workers) + 1, num_gpus=0, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    print(f"Ray settled {common.wait_settled():.0f} s after start", flush=True)
    results = []
    try:
        for fam in args.families:
            for w in args.workers:
                settle = common.wait_settled()  # the last job's workers gone
                busy = common.busy_cores(1.0)
                print(f"{fam} x {w} workers (others' load {busy:.2f} cores; waited {settle:.0f} s "
                      "for this Ray to settle)", flush=True)
                try:
                    res = run_config(tmp, pm.ALL[fam], w, args)
                except Exception as e:  # noqa: BLE001 - said, and the next configuration runs
                    print(f"  {fam} x {w}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                res["busy_before"] = busy
                if args.loop_steps > 0:
                    try:
                        res["loop"] = run_loop(tmp, pm.ALL[fam], w, args)
                    except Exception as e:  # noqa: BLE001 - said; the passes' figures stand
                        print(f"  {fam} x {w} loop: FAILED {type(e).__name__}: {e}", flush=True)
                results.append(res)
                print(f"  pick {res['pick']}, fastest {res['fastest']}, pick/fastest "
                      f"{res['pick_over_fastest']:.3f}", flush=True)
                print(table([res]), flush=True)  # each configuration as it ends
                if args.json:  # what is done survives a run cut short
                    _dump(args, commit, results)
    finally:
        ray.shutdown()
        killed = common.kill_leftovers(tmp)
        if killed:
            print(f"killed {killed} stray Ray processes", flush=True)
    print(f"\ntotal {time.time() - t0:.0f}s, loadavg now {os.getloadavg()[0]:.1f}\n")
    print(table(results))
    if args.json:
        _dump(args, commit, results)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
