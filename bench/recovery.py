"""Recovery benchmark: elastic vs Ray Train's TorchTrainer when a node is lost mid-run.

Same workload for every system (``bench/_recov_common.py``: a 0.56M-parameter MLP, Adam,
global batch 48, a fixed 50 ms wait per step, a checkpoint every ``--every`` steps), same
cluster (a fresh ``ray.cluster_utils.Cluster`` per run: a head with 0 CPUs and fast health
checks as in tests/ray_fixtures.py, plus 3 worker nodes of 1 CPU, one worker per node), same
fault: once ``--kill-step`` steps are done, the node hosting rank 1 is removed
(``remove_node(allow_graceful=False)``) and, by default, a fresh 1-CPU node is added right
after (a fixed-size Ray Train job cannot continue without one).

Systems (``--systems``):

- ``elastic``: ``num_workers=3, min_workers=2, max_workers=3``, checkpoints every K steps
  to local storage, ``replacement_timeout_s=5`` (waits up to 5 s for a replacement);
- ``elastic-nowait``: the same with ``replacement_timeout_s=0`` (goes on with the survivors
  at once, starts the replacement in the background and takes it in at a step boundary once
  it is up: the default since 2026-11-30);
- ``raytrain``: ``ScalingConfig(num_workers=3)``, ``FailureConfig(max_failures=3)``, rank 0
  reports a checkpoint (model, optimizer, next step) every K steps with
  ``ray.train.report``, resume from ``ray.train.get_checkpoint()``;
- ``raytrain-elastic``: the same with ``ScalingConfig(num_workers=(2, 3))`` (Ray 2.60).

Reported per run, all times from ``remove_node``: when the system noticed (elastic: the
controller caught the group failure, the "failure" event's time minus its ``detect_s``;
Ray Train: a survivor's collective raised, and the first survivor process was torn down),
the restart/recovery point, the first step completed after the loss, steps lost (elastic:
the "recovered" event; Ray Train: last step done before the loss + 1 - the step it resumed
from), and whether the survivors' processes were restarted (pids before/after).

Each run is a subprocess (``bench/_recov_run.py``: one process owns the cluster and removes
and adds nodes, another drives the system under test) with its own RAY_TMPDIR and a time
limit; whatever it leaves behind is killed. Runs go in rounds ``elastic, elastic-nowait, raytrain,
raytrain-elastic, ...``; tables give medians over rounds.

    python bench/recovery.py --rounds 2 --json /tmp/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _strat_common as common  # noqa: E402

SYSTEMS = ("elastic", "elastic-nowait", "raytrain", "raytrain-elastic")


def run_one(system: str, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix=f"rr-{system[:2]}{system[-2:]}-", dir="/tmp")
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_TMPDIR=os.path.join(tmp, "ray"), RAY_AUTH_MODE="disabled",
               ELASTIC_CACHE_DIR=os.path.join(tmp, "elastic-cache"),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, BENCH, env.get("PYTHONPATH", "")]).rstrip(":"))
    os.makedirs(env["RAY_TMPDIR"])
    sysarg = "elastic" if system.startswith("elastic") else system
    cmd = [sys.executable, os.path.join(BENCH, "_recov_run.py"), sysarg, out,
           "--steps", str(args.steps), "--every", str(args.every),
           "--kill-step", str(args.kill_step), "--timeout", str(args.timeout_s)]
    if system == "elastic-nowait":
        cmd += ["--replacement-timeout", "0"]
    if system.startswith("elastic"):
        cmd += ["--strategy", args.strategy, "--peer-copies-every", str(args.peer_copies_every),
                "--family", args.family, "--workers", str(args.workers),
                "--kill-rank", str(args.kill_rank)]
    if args.replacement:
        cmd.append("--replacement")
        if args.replacement_nice:
            cmd += ["--replacement-nice", str(args.replacement_nice)]
    busy = common.busy_cores(1.0)
    t0 = time.time()
    log = os.path.join(tmp, "log.txt")
    err = ""
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=args.timeout_s + 120)
        except subprocess.TimeoutExpired:
            err = f"timed out after {args.timeout_s + 120:.0f}s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            killed = common.kill_leftovers(tmp)
    res: dict[str, Any] = {"system": system, "round": rnd, "busy_before": busy,
                           "wall_s": time.time() - t0, "leftovers_killed": killed}
    for name in ("owner.json", "result.json"):  # the cluster owner's times, the driver's
        path = os.path.join(out, name)
        if os.path.exists(path):
            with open(path) as f:
                res.update({k: v for k, v in json.load(f).items() if k != "wall_s"})
    if "status" not in res:
        res["status"] = "no result"
    if err:
        res["status"], res["error"] = "timeout", err
    if res.get("status") not in ("finished",):
        with open(log, errors="replace") as f:
            res["log_tail"] = f.read()[-4000:]
    res["system"] = system
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        res["tmp"] = tmp
    return res


def figures(r: dict[str, Any]) -> dict[str, Any]:
    """Times relative to remove_node, steps lost, survivors restarted."""
    t = r.get("t_remove")

    def rel(key: str) -> float | None:
        v = r.get(key)
        return None if v is None or t is None else v - t

    f: dict[str, Any] = {"status": r.get("status"), "world_after": r.get("world_after"),
                         "survivors_restarted": r.get("survivors_restarted")}
    if r["system"].startswith("elastic"):
        f["noticed_s"] = rel("t_noticed")
        f["noticed_by"] = r.get("noticed_by")
        f["ray_node_dead_s"] = rel("t_ray_node_dead")
        f["failure_event_s"] = rel("t_failure_event")
        f["recovered_s"] = rel("t_recovered")
        f["first_step_s"] = rel("t_first_step_after")
        rec = r.get("recovered") or {}
        f["steps_lost"] = rec.get("steps_lost")
        f["source"] = rec.get("source")
        f["restart_s"] = None
        f["worker_exit_s"] = rel("t_worker_exit")
        f["breakdown"] = breakdown(r)
    else:
        f["noticed_s"] = rel("t_first_error")
        f["teardown_s"] = rel("t_survivor_exit_first")
        f["restart_s"] = rel("t_restart")
        f["first_step_s"] = rel("t_first_step_after")
        lb, rs = r.get("last_step_before"), r.get("resume_step")
        f["steps_lost"] = None if lb is None or rs is None else lb + 1 - rs
        f["source"] = f"checkpoint step {rs}" if rs is not None else None
    f["last_step_before"] = r.get("last_step_before")
    return f


PARTS = ("detect", "abort", "regroup", "restore", "first step")


def breakdown(r: dict[str, Any]) -> dict[str, float] | None:
    """Where elastic's loss -> next step goes, from ``remove_node`` on: *detect* (until the
    controller's watch returned the failure), *abort* (the survivors' segments ended: the
    collective they were in failed or was left, ``wind_down``, and they were pinged,
    ``survivors``), *regroup* (drop the dead, roll forward, leave, progress, drain, replacements,
    the new group, ``form``, and its layout, ``fit``), *restore* (the state, from peers or
    storage) and *first step* (until rank 0 ended the new group's first step)."""
    keys = ("t_remove", "t_noticed", "t_failure_event", "t_recovered", "t_first_step_after")
    if any(r.get(k) is None for k in keys):
        return None
    t_rm, t_n, t_f, t_rec, t_step = (float(r[k]) for k in keys)
    restores = [(a, d) for n, a, d in r.get("spans") or () if n == "restore" and t_f <= a <= t_rec]
    t_restore = restores[0][0] if restores else t_rec
    return {"detect": t_n - t_rm, "abort": t_f - t_n, "regroup": t_restore - t_f,
            "restore": t_rec - t_restore, "first step": t_step - t_rec}


def _med(xs: list[Any]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(xs) if xs else None


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(runs: list[dict[str, Any]], systems: list[str]) -> str:
    lines = ["| system | runs ok | noticed (s) | elastic: recovered event / Ray Train: teardown, "
             "restart (s) | loss -> next completed step (s) | steps lost | state from | "
             "survivors restarted | world after | per round: next step (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    meds: dict[str, float | None] = {}
    for s in systems:
        rs = [r for r in runs if r["system"] == s]
        fs = [figures(r) for r in rs]
        ok = [f for f in fs if f["status"] == "finished" and f["first_step_s"] is not None]
        nxt = _med([f["first_step_s"] for f in ok])
        meds[s] = nxt
        if s.startswith("elastic"):
            mid = _fmt(_med([f["recovered_s"] for f in ok]))
        else:
            mid = (f"{_fmt(_med([f.get('teardown_s') for f in ok]))}, "
                   f"{_fmt(_med([f['restart_s'] for f in ok]))}")
        lost = sorted({f["steps_lost"] for f in ok if f["steps_lost"] is not None})
        src = sorted({str(f["source"]) for f in ok})
        rest = sorted({_fmt(f["survivors_restarted"]) for f in ok})
        world = sorted({str(f["world_after"]) for f in ok})
        per = ", ".join(_fmt(f["first_step_s"]) if f in ok else str(f["status"]) for f in fs)
        lines.append(f"| {s} | {len(ok)}/{len(rs)} | {_fmt(_med([f['noticed_s'] for f in ok]))}"
                     f" | {mid} | {_fmt(nxt)} | {', '.join(map(str, lost)) or 'n/a'} | "
                     f"{'; '.join(src)} | {', '.join(rest)} | {', '.join(world)} | {per} |")
    out = "\n".join(lines)
    for s in systems:  # where elastic's time goes, medians over rounds
        bds = [b for b in (figures(r).get("breakdown") for r in runs if r["system"] == s) if b]
        if bds:
            out += (f"\n\n{s}: loss -> next step, median over {len(bds)} round(s): " + ", ".join(
                f"{k} {_fmt(_med([b[k] for b in bds]))}s" for k in PARTS) + "; the lost rank's "
                "process ended at " + ", ".join(_fmt(figures(r).get("worker_exit_s"))
                                                for r in runs if r["system"] == s) + "s")
    for s in systems:
        fs = [figures(r) for r in runs if r["system"] == s and s.startswith("elastic")]
        if fs:  # which signal came first, against Ray's own view of the node
            out += (f"\n\n{s}: first signal per round: " + ", ".join(
                f"{f.get('noticed_by') or '?'} at {_fmt(f['noticed_s'])}s (Ray marked the node "
                f"dead at {_fmt(f.get('ray_node_dead_s'))}s)" for f in fs))
            nxt = meds.get(s)
            if nxt:
                out += (f"; loss -> next completed step {nxt:.2f}s (goal < 1.5 s: "
                        f"{'met' if nxt < 1.5 else 'NOT met'})")
    rt = [meds.get(s) for s in ("raytrain", "raytrain-elastic") if meds.get(s)]
    for s in ("elastic", "elastic-nowait"):
        if meds.get(s) and rt:
            out += (f"\n\n{s}: next step {meds[s]:.2f}s after the loss "
                    f"(goal < 3 s: {'met' if meds[s] < 3 else 'NOT met'}); vs Ray Train "
                    + ", ".join(f"{x / meds[s]:.1f}x slower" for x in rt)
                    + f" (goal: elastic under a fifth: "
                    f"{'met' if all(meds[s] < x / 5 for x in rt) else 'NOT met'})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    ap.add_argument("--kill-step", type=int, default=25)
    ap.add_argument("--replacement", action=argparse.BooleanOptionalAction, default=True,
                    help="add a fresh node right after the removal")
    ap.add_argument("--replacement-nice", type=int, default=0,
                    help="niceness of the replacement node's processes (raylet, agents, "
                    "workers): on one machine they share the cores the job trains on, where "
                    "on a cluster they start on another machine; 19 stands in for that")
    ap.add_argument("--strategy", default="dp", help="elastic's layout (zero3: the lost shard "
                    "comes from the checkpoint, or with --peer-copies-every from the buddies' "
                    "copies)")
    ap.add_argument("--peer-copies-every", type=int, default=0,
                    help="elastic's peer_copies_every (0: off, the default)")
    ap.add_argument("--family", default="recov", help="elastic's workload: recov (the one "
                    "above) or a family of bench/_planner_models.py (mlp, convnet, gpt, mixer, "
                    "dlrm), the same 50 ms wait per step; elastic systems only")
    ap.add_argument("--workers", type=int, default=3, help="elastic's workers (and 1-CPU "
                    "nodes); elastic systems only")
    ap.add_argument("--kill-rank", type=int, default=1, help="the rank whose node is removed; "
                    "elastic systems only")
    ap.add_argument("--timeout-s", type=float, default=240, help="per run, after the kill")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s}")
    if (args.family, args.workers, args.kill_rank) != ("recov", 3, 1) and any(
            s.startswith("raytrain") for s in systems):
        ap.error("--family, --workers and --kill-rank are for elastic's systems only: "
                 "add --systems elastic-nowait")
    if not 0 <= args.kill_rank < args.workers:
        ap.error(f"--kill-rank must be a rank of the {args.workers} workers")
    print(f"recovery benchmark: {args.family}, {args.workers} workers, {args.strategy}, peer "
          f"copies every {args.peer_copies_every}; {args.steps} steps, checkpoint every "
          f"{args.every}, node of rank {args.kill_rank} removed after step {args.kill_step}, "
          f"replacement node: {args.replacement}; "
          f"systems {systems}, {args.rounds} rounds; code {common.code_version()}; loadavg "
          f"{os.getloadavg()[0]:.1f}",
          flush=True)
    t0 = time.time()
    runs = []
    for rnd in range(args.rounds):
        for s in systems:
            r = run_one(s, rnd, args)
            runs.append(r)
            f = figures(r)
            print(f"round {rnd + 1} {s:16s} {r.get('status')}: noticed {_fmt(f['noticed_s'])}s,"
                  f" recovered/restart {_fmt(f.get('recovered_s') or f.get('restart_s'))}s, "
                  f"next step {_fmt(f['first_step_s'])}s, steps lost {f['steps_lost']} "
                  f"(last before {f['last_step_before']}, from {f['source']}), survivors "
                  f"restarted {_fmt(f['survivors_restarted'])}, world after {f['world_after']}"
                  f", run wall {r['wall_s']:.0f}s, others' load before {r['busy_before']:.2f} "
                  f"cores" + (f" [killed {r['leftovers_killed']} stray]"
                              if r["leftovers_killed"] else ""), flush=True)
            for _, lv in (r.get("leaves") or [])[:2]:  # the survivors' own timings
                print("   " + "; ".join(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                                                  f"{k} {v}" for k, v in x.items())
                                        for x in lv), flush=True)
            if f.get("breakdown"):
                print("   " + ", ".join(f"{k} {v:.2f}s" for k, v in f["breakdown"].items())
                      + f"; first signal {f.get('noticed_by')}, lost rank's process ended at "
                      f"{_fmt(f.get('worker_exit_s'))}s, Ray marked the node dead at "
                      f"{_fmt(f.get('ray_node_dead_s'))}s", flush=True)
            if r.get("status") != "finished":
                print(f"   error: {str(r.get('error'))[-1500:]}\n   log: "
                      f"{str(r.get('log_tail'))[-1500:]}", flush=True)
    print(f"\ntotal {time.time() - t0:.0f}s, loadavg now {os.getloadavg()[0]:.1f}\n")
    print(table(runs, systems))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs,
                       "figures": [figures(r) | {"system": r["system"], "round": r["round"]}
                                   for r in runs]}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
