"""Node-loss stress: repeat real node losses until a rare survivor crash shows (issue 13, 5).

Each run is one job on a ``ray.cluster_utils.Cluster`` (tests/ray_fixtures.py's
``ChaosCluster``: a 0-CPU head with fast health checks plus one 1-CPU node per worker), one
worker's node removed under it (``remove_node(allow_graceful=False)``, no replacement node
during the job), and the job run to its end.

Several losses per cluster (``--losses-per-cluster K``, default 4): a fresh cluster costs 30-60
s on a loaded 2-core machine, more than the run itself, so K runs share one. After each run
(its job ended, its workers gone) a fresh 1-CPU node replaces the one removed, and the next run
is a new job, with new worker processes on as many nodes as before. It is the same test: what
it stresses is what one job's surviving processes do after a peer's node goes (leave the
destroyed group, restart in the same process or restore from peers or a checkpoint), and every
run starts that afresh: new processes, a new job, a new group, one real node loss. Only Ray's
head and the nodes not removed are reused (as on a real cluster, where jobs come and go). A
run that does not survive ends its cluster (the next go to a fresh one), so a broken cluster
never counts against later runs. Crashes are attributed by pid: each run records its workers'
pids and a crashed process's log names its pid. ``--losses-per-cluster 1`` is the old one
cluster per run. The job keeps the product's failure settings (``replacement_timeout_s: 0``, the
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

Every cluster is a child process (this file with ``--child``) in its own session, with its own
``RAY_TMPDIR`` and a time limit; its cluster is shut down in the child, and whatever the run
left running (processes whose command line names the run's temp dir) is killed by pid. The
logs of a run with a crash are kept (``--keep`` keeps all). Results are merged into the JSON
file (``--json``, keyed by scenario and repetition), so batches add up; the summary table is
printed over everything in it. Run it in batches under the machine's lock, e.g.:

    RAY_TMPDIR=... flock /tmp/elastic-ray.lock python bench/stress_node_loss.py \\
        --scenarios zero3 ppzero --reps 0:10 --budget-s 240 --malloc-check --json /tmp/stress.json
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


def child(plans: list[dict[str, Any]], out_path: str, work: str, deadline: float) -> None:
    """Runs ``plans`` one after another on one cluster (a job each, one loss each, a fresh
    node added after each); writes the records to ``out_path`` as they are done. No run
    starts after ``deadline`` (time.time()), and none after a run that did not survive (the
    next plans then go to a fresh cluster)."""
    from elastic.reference import reference_train
    from tests.helpers import RegressionData, adam, mlp, mse
    from tests.ray_fixtures import ChaosCluster

    recs: list[dict[str, Any]] = []
    t0 = time.time()
    cluster = None
    try:
        cluster = ChaosCluster(SCENARIOS[plans[0]["scenario"]]["workers"])
        cluster_s = time.time() - t0
        ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, STEPS, seed=0)
        for i, p in enumerate(plans):
            if time.time() > deadline:
                break
            if i:
                cluster.nodes.append(cluster.add_node())  # the lost node's replacement
            rec = one_loss(p, cluster, ref, os.path.join(work, f"run{i}"))
            rec["cluster_s"] = cluster_s if i == 0 else 0.0
            rec["loss_in_cluster"] = i
            recs.append(rec)
            _dump(out_path, recs)
            if not rec.get("survived"):
                break
    except Exception as e:  # noqa: BLE001 - the harness failed; said in the record
        recs.append(dict(plans[len(recs)], survived=False,
                         harness_error=f"{type(e).__name__}: {e}\n"
                                       f"{traceback.format_exc()[-1500:]}"))
    finally:
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:  # noqa: BLE001
                if recs:
                    recs[-1]["shutdown_error"] = f"{type(e).__name__}: {e}"
        _dump(out_path, recs)


def _dump(path: str, recs: list[dict[str, Any]]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(recs, f, default=str)
    os.replace(path + ".tmp", path)


def one_loss(p: dict[str, Any], cluster: Any, ref: dict[str, Any], work: str) -> dict[str, Any]:
    """One job on ``cluster``, one worker's node removed under it, the job run to its end."""
    import elastic
    from tests.helpers import RegressionData, adam, max_diff, mlp

    sc = SCENARIOS[p["scenario"]]
    rec: dict[str, Any] = dict(p)
    t0 = time.time()
    cfg: dict[str, Any] = dict(
        model=mlp, optimizer=adam, loss=slow_mse, dataset=RegressionData(),
        global_batch_size=G, max_steps=STEPS, num_workers=sc["workers"],
        min_workers=sc["min_workers"], max_workers=sc["workers"], view="none",
        run_dir=os.path.join(work, "run"), strategy=sc["strategy"], name=f"stress-{p['rep']}",
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
    pids: set[int] = set()
    try:
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
        pids |= set(rec["pids_before"].values())
        rec["t_remove"] = time.time() - t0
        cluster.remove(node)
        try:
            result = handle.result(timeout=150)
            rec["survived"] = True
            events = result.events
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
        for e in events:
            pids |= {int(x) for x in (e.data.get("pids") or ()) if x}
        # a loss that came after the job's last step tested nothing (counted apart)
        rec["loss_hit"] = not rec["survived"] or any(e.kind == "failure" for e in events)
        rec["events"] = [(round(e.time - events[0].time, 2), e.kind, e.message[:200])
                         for e in events] if events else []
    finally:  # (a job still running here is stopped with its cluster)
        rec["pids"] = sorted(pids)
        rec["wall_s"] = time.time() - t0
    return rec


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


def _pid_of(path: str) -> int | None:
    """The process a Ray log file belongs to (``worker-<id>-<job>-<pid>.err``,
    ``python-core-worker-<id>_<pid>.log``); None for the raylet's."""
    m = re.search(r"[-_](\d+)\.(?:err|out|log)$", os.path.basename(path))
    return int(m.group(1)) if m and "raylet" not in path else None


def run_cluster(plans: list[dict[str, Any]], args: argparse.Namespace,
                deadline: float) -> list[dict[str, Any]]:
    """``plans`` on one fresh cluster (a child process, ``child``); one record per loss run,
    each with the crashes found in the logs of its own workers (by pid)."""
    p0 = plans[0]
    short = "".join(w[0] for w in p0["scenario"].split("-"))  # Ray's socket paths are short
    work = tempfile.mkdtemp(prefix=f"{short}{p0['rep']}-", dir=args.tmp)
    ray_tmp = os.path.join(work, "ray")
    os.makedirs(ray_tmp)
    out = os.path.join(work, "records.json")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
               LIBC_FATAL_STDERR_="1", PYTHONFAULTHANDLER="1",
               ELASTIC_CACHE_DIR=os.path.join(work, "elastic-cache"),
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(":"))
    if args.malloc_check:  # glibc >= 2.34 checks only with its debug library preloaded
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_="165",
                   LD_PRELOAD=" ".join(glob.glob("/usr/lib/*/libc_malloc_debug.so.0")[:1]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(plans), out, work,
           str(deadline)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=open(os.path.join(work, "child.log"), "w"),
                            stderr=subprocess.STDOUT)
    limit = args.run_timeout_s + max(0.0, deadline - t0)
    try:
        proc.wait(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        with open(out) as f:
            recs = json.load(f)
    except (OSError, json.JSONDecodeError):
        recs = []
    if timed_out or not recs:
        with open(os.path.join(work, "child.log"), errors="replace") as f:
            tail = f.read()[-1500:]
        rec = (recs.pop() if recs and not recs[-1].get("survived") else
               dict(plans[len(recs)], survived=False))
        rec.setdefault("harness_error", (f"timed out after {limit:.0f} s" if timed_out else
                                         "no record") + "; child log tail:\n" + tail)
        rec["survived"] = False
        recs.append(rec)
    leftovers = _kill_leftovers(work)
    found = crashes(ray_tmp)
    keep = bool(found) or args.keep or not all(r.get("survived") for r in recs)
    for i, rec in enumerate(recs):
        mine = set(rec.get("pids") or ())
        rec["crashes"] = [c for c in found if _pid_of(c["file"]) in mine
                          or (_pid_of(c["file"]) is None and i == len(recs) - 1)]
        rec["crash_kind"] = _crash_kind(rec["crashes"])
        rec["leftovers_killed"] = leftovers if i == len(recs) - 1 else []
        rec["run_s"] = rec.get("wall_s", 0.0) + rec.get("cluster_s", 0.0)
        rec["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        rec["commit"] = args.commit
        rec["malloc_check"] = bool(args.malloc_check)
        rec["losses_per_cluster"] = len(plans)
        if keep:
            rec["kept"] = work
    stray = [c for c in found if not any(c in r["crashes"] for r in recs)]
    if stray:  # a crash of a process no run names: the cluster's, said on its last record
        recs[-1]["crashes"] += stray
        recs[-1]["crash_kind"] = _crash_kind(recs[-1]["crashes"])
    if keep:
        for d in glob.glob(os.path.join(work, "run*", "run", "checkpoints")):
            shutil.rmtree(d, ignore_errors=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return recs


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
        rs = [r for r in runs if r["scenario"] == sc and r.get("loss_hit", True)]
        missed = sum(1 for r in runs if r["scenario"] == sc and not r.get("loss_hit", True))
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
                    f"{'; '.join(fails)[:200]}"
                    + (f" ({missed} more ran after the job's end: no loss tested)" if missed
                       else ""))
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
    ap.add_argument("--losses-per-cluster", type=int, default=4,
                    help="node losses (one job each) per fresh cluster; 1: a cluster per loss")
    ap.add_argument("--child", nargs=4, metavar=("PLANS", "OUT", "WORK", "DEADLINE"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child[0]), args.child[1], args.child[2], float(args.child[3]))
        return
    data = _load(args.json)
    if not args.summary:
        args.commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
        a, b = (int(x) for x in args.reps.split(":"))
        t_start = time.time()
        deadline = t_start + args.budget_s
        # interleave the scenarios (a batch cut by the budget covers them all); each cluster
        # takes up to --losses-per-cluster repetitions of one scenario
        todo = {sc: [rep for rep in range(a, b)
                     if args.redo or f"{args.label}/{sc}/{rep}" not in data["runs"]]
                for sc in args.scenarios}
        while any(todo.values()) and time.time() < deadline:
            for sc in args.scenarios:
                reps, todo[sc] = todo[sc][:args.losses_per_cluster], \
                    todo[sc][args.losses_per_cluster:]
                if not reps or time.time() >= deadline:
                    continue
                recs = run_cluster([plan(sc, rep, args.seed) for rep in reps], args, deadline)
                done = {r["rep"] for r in recs}
                todo[sc] = [r for r in reps if r not in done] + todo[sc]
                data = _load(args.json)
                for rec in recs:
                    key = f"{args.label}/{sc}/{rec['rep']}"
                    rec["label"] = args.label
                    data["runs"][key] = rec
                    print(f"{key:<22} survived={rec.get('survived')!s:<5} "
                          f"match={rec.get('match')!s:<5} crash={rec.get('crash_kind')} "
                          f"rec={[(x['source'], round(x['seconds'] or 0, 1)) for x in rec.get('recovered', [])]} "
                          f"{rec['run_s']:.0f}s (loss {rec.get('loss_in_cluster')} of its "
                          f"cluster) {(rec.get('error') or rec.get('harness_error') or '')[:120]}",
                          flush=True)
                _save(args.json, data)
        if any(todo.values()):
            print(f"budget of {args.budget_s:.0f} s spent; stopping", flush=True)
    runs = list(data["runs"].values())
    for label in sorted({r.get("label", "") for r in runs}):
        print(summary([r for r in runs if r.get("label", "") == label],
                      f"label {label!r}" if label else ""))


if __name__ == "__main__":
    main()
