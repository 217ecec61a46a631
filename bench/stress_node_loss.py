"""Node-loss stress: repeat real node losses until a rare survivor crash shows (issue 13, 5).

Each run is a fresh ``ray.cluster_utils.Cluster`` (tests/ray_fixtures.py's ``ChaosCluster``: a
0-CPU head with fast health checks plus one 1-CPU node per worker), one job on it, one worker's
node removed (``remove_node(allow_graceful=False)``, no replacement node), and the job run to
its end. The job keeps the product's failure settings (``replacement_timeout_s: 0``, the
survivors go on at once; ``hang_timeout_s: 60``), except ``min_workers_timeout_s: 10`` (a job
left below ``min_workers`` by a crash fails sooner). Scenarios (``--scenarios``):

- ``zero3``: zero3 on 3 workers (``min_workers=2``), no checkpoint: no rank holds a whole
  entry, so the survivors restart from step 0 *in the same processes*;
- ``zero3-ckpt``: the same with a checkpoint every 5 steps: recovery loads it (or restarts
  from step 0 when the loss lands before the first commit);
- ``ppzero``: pipeline pp2 x zero on 4 workers (``min_workers=3``), ``dp_mode`` zero2 on
  even repetitions and zero3 on odd ones, no checkpoint;
- ``ppzero-ckpt``: the same with a checkpoint every 5 steps.

Where the loss lands: three runs in four pick a (rank, step) and use the fault hook
``faults: [{rank, step, action: pause}]`` (the rank blocks at the start of that step and says on
which node it runs; that node is removed, as tests/chaos/test_chaos.py does); the fourth removes a
random worker's node at a random moment (once a random step is done, after a random delay of
0-100 ms). Choices come from ``--seed`` and the repetition number, so a run can be repeated.

Recorded per run: survived or not (the job's result or error), every crashed worker process
found in the Ray session's logs under the run's private ``RAY_TMPDIR`` (``free():``,
``corrupted``, ``double free``, ``malloc():``, ``SIGABRT``/``SIGSEGV``, ``Fatal Python
error``: the matching lines and the Python stack faulthandler printed), the recovery source
and seconds (the ``recovered`` events), and whether the final parameters match the
single-process reference (``elastic.reference.reference_train``) within 1e-5.

Every run is a child process (this file with ``--child``) in its own session, with its own
``RAY_TMPDIR`` and a time limit; its cluster is shut down in the child, and whatever the run
left running (processes whose command line names the run's temp dir) is killed by pid. The
logs of a run with a crash are kept (``--keep`` keeps all). Results are merged into the JSON
file (``--json``, keyed by scenario and repetition), so batches add up; the summary table is
printed over everything in it. Run it in batches under the machine's lock, e.g.:

    RAY_TMPDIR=... flock /tmp/elastic-ray.lock python bench/stress_node_loss.py \\
        --scenarios zero3 zero3-ckpt --reps 0:10 --budget-s 1100 --json /tmp/stress.json
    python bench/stress_node_loss.py --json /tmp/stress.json --summary

``--malloc-check`` runs the workers with ``MALLOC_CHECK_=3 MALLOC_PERTURB_=165`` and glibc's
``libc_malloc_debug.so`` preloaded (glibc checks every free and fills freed memory), which
turns a late write into freed memory into an earlier, louder crash.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCENARIOS: dict[str, dict[str, Any]] = {
    "zero3": {"workers": 3, "min_workers": 2, "strategy": "zero3", "checkpoint": False},
    "zero3-ckpt": {"workers": 3, "min_workers": 2, "strategy": "zero3", "checkpoint": True},
    "ppzero": {"workers": 4, "min_workers": 3, "strategy": "pipeline", "checkpoint": False},
    "ppzero-ckpt": {"workers": 4, "min_workers": 3, "strategy": "pipeline", "checkpoint": True},
}
G = 12
STEPS = 40
TOL = 1e-5
STEP_SLEEP_S = 0.05  # long enough steps to land a loss mid-run (as tests/chaos/test_chaos.py)
# what a crashed worker leaves in its log: glibc's heap checks, faulthandler's report, signals
CRASH = re.compile(r"free\(\)|corrupted|double free|malloc\(\)|malloc_consolidate|munmap_chunk|"
                   r"invalid pointer|Fatal Python error|Segmentation fault|SIGABRT|SIGSEGV|"
                   r"core dumped|\bAborted\b", re.IGNORECASE)
NOT_A_CRASH = ("Raylet is terminated", "ResourceRoute", "Monitor events")
LOGS = ("worker-*.err", "worker-*.out", "python-core-worker-*.log", "raylet*.out")


def slow_mse(out: Any, y: Any) -> Any:
    time.sleep(STEP_SLEEP_S)
    from tests.helpers import mse

    return mse(out, y)


def plan(scenario: str, rep: int, seed: int) -> dict[str, Any]:
    """Where the loss lands in repetition ``rep`` (deterministic in seed, scenario, rep)."""
    sc = SCENARIOS[scenario]
    rng = random.Random(f"{seed}/{scenario}/{rep}")
    p: dict[str, Any] = {"scenario": scenario, "rep": rep, "seed": seed,
                         "dp_mode": ("zero2" if rep % 2 == 0 else "zero3")
                         if sc["strategy"] == "pipeline" else None}
    if rep % 4 == 3:
        p.update(kind="random", rank=rng.randrange(sc["workers"]),
                 after_step=rng.randint(2, STEPS - 10), delay_s=rng.uniform(0.0, 0.1))
    else:
        p.update(kind="pause", rank=rng.randrange(sc["workers"]),
                 step=rng.randint(1, STEPS - 6))
    return p


# ------------------------------------------------------------------------------ child: one run


def _wait(cond: Any, handle: Any, timeout: float, what: str) -> Any:
    t0 = time.time()
    while True:
        got = cond()
        if got:
            return got
        if handle.done():
            raise RuntimeError(f"the job ended while waiting for {what}")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waiting for {what}")
        time.sleep(0.01)


def child(p: dict[str, Any], out_path: str, work: str) -> None:
    """One run; writes its record to ``out_path``."""
    import elastic
    from elastic.reference import reference_train
    from tests.helpers import RegressionData, adam, max_diff, mlp, mse
    from tests.ray_fixtures import ChaosCluster

    sc = SCENARIOS[p["scenario"]]
    rec: dict[str, Any] = dict(p)
    t0 = time.time()
    cluster = None
    try:
        cluster = ChaosCluster(sc["workers"])
        rec["cluster_s"] = time.time() - t0
        cfg: dict[str, Any] = dict(
            model=mlp, optimizer=adam, loss=slow_mse, dataset=RegressionData(),
            global_batch_size=G, max_steps=STEPS, num_workers=sc["workers"],
            min_workers=sc["min_workers"], max_workers=sc["workers"], view="none",
            run_dir=os.path.join(work, "run"), strategy=sc["strategy"],
            min_workers_timeout_s=10)  # (the default 60 s only delays a failed run's end)
        if sc["strategy"] == "pipeline":
            cfg.update(pp_degree=2, dp_mode=p["dp_mode"])
        if sc["checkpoint"]:
            cfg.update(checkpoint_every=5, checkpoint_uri=os.path.join(work, "ckpt"))
        faults_dir = os.path.join(work, "faults")
        if p["kind"] == "pause":
            cfg["faults"] = [{"rank": p["rank"], "step": p["step"], "action": "pause",
                              "dir": faults_dir}]
        handle = elastic.submit(**cfg)
        ctl = handle.controller
        if p["kind"] == "pause":
            path = os.path.join(faults_dir, f"paused-rank{p['rank']}-step{p['step']}.json")
            _wait(lambda: os.path.exists(path), handle, 180, "the paused rank")
            time.sleep(0.01)
            with open(path) as f:
                node = json.load(f)["node_id"]
        else:
            _wait(lambda: handle.status()["step"] >= p["after_step"], handle, 180,
                  f"step {p['after_step']}")
            time.sleep(p["delay_s"])
            node = next(w.info["node_id"] for w in ctl.workers if w.rank == p["rank"])
        rec["pids_before"] = {str(w.rank): w.info["pid"] for w in ctl.workers}
        rec["t_remove"] = time.time() - t0
        cluster.remove(node)
        try:
            result = handle.result(timeout=150)
            rec["survived"] = True
            events = result.events
            ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)
            rec["max_diff"] = max_diff(result.state_dict(), ref)
            rec["match"] = rec["max_diff"] < TOL
            rec["steps"] = len(result.history)
        except Exception as e:  # noqa: BLE001 - the job failed: that is the record
            rec["survived"] = False
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            events = list(ctl.events)
            if isinstance(e, TimeoutError):  # a hang: where is everyone?
                rec["stacks"] = _stacks([w.info["pid"] for w in ctl.workers])
        rec["recovered"] = [{"source": e.data.get("source"), "seconds": e.data.get("seconds"),
                             "steps_lost": e.data.get("steps_lost"),
                             "world_size": e.data.get("world_size"),
                             "strategy": e.data.get("strategy")}
                            for e in events if e.kind == "recovered"]
        rec["events"] = [(round(e.time - events[0].time, 2), e.kind, e.message[:200])
                         for e in events] if events else []
    except Exception as e:  # noqa: BLE001 - the harness failed; said in the record
        rec["survived"] = False
        rec["harness_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    finally:
        rec["wall_s"] = time.time() - t0
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:  # noqa: BLE001
                rec["shutdown_error"] = f"{type(e).__name__}: {e}"
        with open(out_path, "w") as f:
            json.dump(rec, f, default=str)


def _stacks(pids: list[int]) -> dict[str, str]:
    """Each process's Python stacks (``py-spy dump``, where installed)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = {}
    for pid in pids:
        try:
            out[str(pid)] = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                           text=True, timeout=30).stdout[-6000:]
        except (OSError, subprocess.SubprocessError) as e:
            out[str(pid)] = f"py-spy: {e}"
    return out


# ------------------------------------------------------------------------------ parent


def crashes(ray_tmp: str) -> list[dict[str, Any]]:
    """Crashed processes in the Ray session logs under ``ray_tmp``: for each log file with a
    crash signature, the matching lines and the stack faulthandler printed after them."""
    found = []
    paths = sorted({p for pat in LOGS
                    for p in glob.glob(os.path.join(ray_tmp, "**", "logs", pat), recursive=True)
                    if "session_latest" not in p})
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        hits = [i for i, ln in enumerate(lines) if CRASH.search(ln)
                and not any(x in ln for x in NOT_A_CRASH)]
        if not hits:
            continue
        first = hits[0]
        found.append({"file": os.path.relpath(path, ray_tmp),
                      "lines": [lines[i][:300] for i in hits[:12]],
                      "context": [ln[:300] for ln in lines[max(0, first - 3): first + 40]]})
    return found


def _crash_kind(found: list[dict[str, Any]]) -> str | None:
    text = "\n".join(ln for c in found for ln in c["lines"])
    if not text:
        return None
    for key, kind in (("corrupted", "heap corruption"), ("free()", "heap corruption"),
                      ("double free", "heap corruption"), ("malloc()", "heap corruption"),
                      ("munmap_chunk", "heap corruption"), ("segmentation", "SIGSEGV"),
                      ("sigsegv", "SIGSEGV"), ("sigabrt", "SIGABRT"), ("aborted", "SIGABRT")):
        if key in text.lower():
            return kind
    return "other"


def _kill_leftovers(tag: str) -> list[int]:
    """Processes whose command line names this run's temp dir (raylets, workers a shutdown
    missed): killed by pid."""
    killed = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmd:
            try:
                os.kill(int(d), signal.SIGKILL)
                killed.append(int(d))
            except OSError:
                pass
    return killed


def run_one(p: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    short = "".join(w[0] for w in p["scenario"].split("-"))  # Ray's socket paths are short
    work = tempfile.mkdtemp(prefix=f"{short}{p['rep']}-", dir=args.tmp)
    ray_tmp = os.path.join(work, "ray")
    os.makedirs(ray_tmp)
    out = os.path.join(work, "record.json")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
               LIBC_FATAL_STDERR_="1", PYTHONFAULTHANDLER="1",
               ELASTIC_CACHE_DIR=os.path.join(work, "elastic-cache"),
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(":"))
    if args.malloc_check:  # glibc >= 2.34 checks only with its debug library preloaded
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_="165",
                   LD_PRELOAD=" ".join(glob.glob("/usr/lib/*/libc_malloc_debug.so.0")[:1]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(p), out, work]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=open(os.path.join(work, "child.log"), "w"),
                            stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=args.run_timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        with open(out) as f:
            rec = json.load(f)
    except (OSError, json.JSONDecodeError):
        rec = dict(p, survived=False)
        with open(os.path.join(work, "child.log"), errors="replace") as f:
            rec["harness_error"] = "no record; child log tail:\n" + f.read()[-1500:]
    if timed_out:
        rec["harness_error"] = f"timed out after {args.run_timeout_s} s"
        rec["survived"] = False
    rec["leftovers_killed"] = _kill_leftovers(work)
    rec["crashes"] = crashes(ray_tmp)
    rec["crash_kind"] = _crash_kind(rec["crashes"])
    rec["run_s"] = time.time() - t0
    rec["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec["commit"] = args.commit
    rec["malloc_check"] = bool(args.malloc_check)
    if rec["crashes"] or not rec.get("survived") or args.keep:
        rec["kept"] = work
        shutil.rmtree(os.path.join(work, "run", "checkpoints"), ignore_errors=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return rec


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {"runs": {}}


def _save(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def summary(runs: list[dict[str, Any]], title: str = "") -> str:
    rows = [f"{title}" if title else "",
            f"{'scenario':<12} {'runs':>4} {'survived':>8} {'crashed':>7} {'heap':>4} "
            f"{'match':>5} {'peers':>5} {'ckpt':>4} {'scratch':>7} {'rec s (med)':>11}  "
            "failures"]
    for sc in SCENARIOS:
        rs = [r for r in runs if r["scenario"] == sc]
        if not rs:
            continue
        surv = sum(1 for r in rs if r.get("survived"))
        crashed = sum(1 for r in rs if r.get("crashes"))
        heap = sum(1 for r in rs if r.get("crash_kind") == "heap corruption")
        match = sum(1 for r in rs if r.get("match"))
        srcs = [x["source"] for r in rs for x in r.get("recovered", [])]
        secs = [x["seconds"] for r in rs for x in r.get("recovered", []) if x.get("seconds")]
        fails = sorted({(r.get("error") or r.get("harness_error") or "")[:60]
                        for r in rs if not r.get("survived")})
        rows.append(f"{sc:<12} {len(rs):>4} {surv:>8} {crashed:>7} {heap:>4} {match:>5} "
                    f"{srcs.count('peers'):>5} {srcs.count('checkpoint'):>4} "
                    f"{srcs.count('scratch'):>7} "
                    f"{statistics.median(secs) if secs else float('nan'):>11.2f}  "
                    f"{'; '.join(fails)[:200]}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--reps", default="0:50", help="repetitions A:B (B excluded)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--json", default="/tmp/stress_node_loss.json")
    ap.add_argument("--tmp", default="/tmp", help="where each run's temp dir goes")
    ap.add_argument("--budget-s", type=float, default=1100.0,
                    help="start no run after this many seconds (a batch under the lock)")
    ap.add_argument("--run-timeout-s", type=float, default=400.0)
    ap.add_argument("--malloc-check", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep every run's logs")
    ap.add_argument("--redo", action="store_true", help="run repetitions already in --json")
    ap.add_argument("--label", default="", help="a name for this set of runs (before/after)")
    ap.add_argument("--summary", action="store_true", help="only print the summary")
    ap.add_argument("--child", nargs=3, metavar=("PLAN", "OUT", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child[0]), args.child[1], args.child[2])
        return
    data = _load(args.json)
    if not args.summary:
        args.commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
        a, b = (int(x) for x in args.reps.split(":"))
        t_start = time.time()
        # interleave the scenarios, so a batch cut by the budget covers them all
        todo = [(sc, rep) for rep in range(a, b) for sc in args.scenarios]
        for sc, rep in todo:
            key = f"{args.label}/{sc}/{rep}"
            if key in data["runs"] and not args.redo:
                continue
            if time.time() - t_start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent; stopping", flush=True)
                break
            rec = run_one(plan(sc, rep, args.seed), args)
            rec["label"] = args.label
            data = _load(args.json)
            data["runs"][key] = rec
            _save(args.json, data)
            print(f"{key:<22} survived={rec.get('survived')!s:<5} match={rec.get('match')!s:<5} "
                  f"crash={rec.get('crash_kind')} rec={[(x['source'], round(x['seconds'] or 0, 1)) for x in rec.get('recovered', [])]} "
                  f"{rec['run_s']:.0f}s {(rec.get('error') or rec.get('harness_error') or '')[:120]}",
                  flush=True)
    runs = list(data["runs"].values())
    for label in sorted({r.get("label", "") for r in runs}):
        print(summary([r for r in runs if r.get("label", "") == label],
                      f"label {label!r}" if label else ""))


if __name__ == "__main__":
    main()
