"""One run of bench/recovery.py: a fresh multi-node ``ray.cluster_utils.Cluster`` (a head with
0 CPUs and fast health checks, as in tests/ray_fixtures.py, plus 3 worker nodes of 1 CPU),
one training system on it, the node hosting rank 1 removed once ``--kill-step`` steps are
done, then (``--replacement``) a fresh 1-CPU node added at once.

    python bench/_recov_run.py SYSTEM OUT_DIR --steps 80 --every 10 --kill-step 25 [--replacement]

Two processes, so that manipulating the cluster never stalls the system under test (adding a
node forks several processes from the process that owns the ``Cluster``, and elastic's
controller runs in its driver process):

- this process **owns the cluster** (``Cluster(connect=False)``), waits for the driver's
  ``kill.json`` (the node to remove), removes it, adds the replacement, and writes the times
  to ``owner.json``;
- the **driver** (this file with ``--driver``) connects with the cluster's address, runs the
  system and writes ``kill.json`` when the kill step is done, then ``result.json``.

SYSTEM: ``elastic`` (``--replacement-timeout`` s of waiting for a replacement worker) or
``raytrain`` / ``raytrain-elastic`` (TorchTrainer, ``ScalingConfig(num_workers=3)`` or
``(2, 3)``, ``FailureConfig(max_failures=3)``); Ray Train's workers log to ``OUT_DIR/prog``.
The caller (bench/recovery.py) bounds the run and kills whatever is left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _recov_common as rc  # noqa: E402


def _write(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)
    os.replace(tmp, path)


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------- owner


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def owner(args: argparse.Namespace) -> None:
    from ray.cluster_utils import Cluster

    out = args.out
    t0 = time.time()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    info: dict[str, Any] = {}
    proc = None
    try:
        nodes = []
        for _ in range(args.workers):
            nodes.append(cluster.add_node(num_cpus=1))
        cluster.wait_for_nodes()
        info["cluster_startup_s"] = time.time() - t0
        cmd = [sys.executable, os.path.abspath(__file__), args.system, out, "--driver",
               "--address", cluster.address, "--steps", str(args.steps), "--every",
               str(args.every), "--kill-step", str(args.kill_step), "--replacement-timeout",
               str(args.replacement_timeout), "--timeout", str(args.timeout),
               "--strategy", args.strategy, "--peer-copies-every", str(args.peer_copies_every),
               "--family", args.family, "--workers", str(args.workers),
               "--kill-rank", str(args.kill_rank)]
        proc = subprocess.Popen(cmd)
        kill = None
        deadline = time.time() + 400
        while kill is None and proc.poll() is None and time.time() < deadline:
            kill = _read(os.path.join(out, "kill.json"))
            if kill is None:
                time.sleep(0.005)
        if kill is not None:
            node = next(n for n in nodes if n.node_id == kill["node_id"])
            info["t_remove"] = time.time()
            cluster.remove_node(node, allow_graceful=False)
            info["t_removed"] = time.time()
            _write(os.path.join(out, "owner.json"), info)
            pid = kill.get("pid")
            if pid:  # the lost rank's process: when it actually ended (Ray ends it, or itself)
                t_end = time.time() + 10
                while _alive(int(pid)) and time.time() < t_end:
                    time.sleep(0.002)
                info["t_worker_exit"] = time.time()
            if args.replacement:
                if args.replacement_nice:  # its raylet, agents and workers inherit it
                    os.nice(args.replacement_nice)
                try:
                    cluster.add_node(num_cpus=1)
                    cluster.wait_for_nodes()
                except Exception as e:
                    info["replacement_error"] = f"{type(e).__name__}: {e}"
                info["t_node_added"] = time.time()
            _write(os.path.join(out, "owner.json"), info)
        else:
            info["error"] = "the driver never asked for the kill"
            _write(os.path.join(out, "owner.json"), info)
        try:
            proc.wait(timeout=args.timeout + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            info["error"] = "driver timed out"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        cluster.shutdown()
        info["wall_s"] = time.time() - t0
        _write(os.path.join(out, "owner.json"), info)


# ---------------------------------------------------------------------------------- driver


def _ask_kill(out: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Ask the owner to remove ``meta["killed_node"]``; wait for its ``t_remove``."""
    _write(os.path.join(out, "kill.json"), {"node_id": meta["killed_node"], "time": time.time(),
                                            "pid": (meta.get("pids_before") or {}).get(
                                                meta.get("killed_rank", 1))})
    deadline = time.time() + 60
    while time.time() < deadline:
        o = _read(os.path.join(out, "owner.json"))
        if o and "t_remove" in o:
            return o
        time.sleep(0.005)
    raise TimeoutError("the owner never removed the node")


# (module, class, method) of the controller's recovery steps
_TRACED = (("elastic.control.controller", "Controller", "_drain"),
           ("elastic.control.regroup", "Regroup", "recover"),
           ("elastic.control.regroup", "Regroup", "resize"),
           ("elastic.control.regroup", "Regroup", "restore"),
           ("elastic.control.regroup", "Regroup", "form"),
           ("elastic.control.regroup", "Regroup", "acquire"),
           ("elastic.control.regroup", "Regroup", "_roll_forward"),
           ("elastic.control.layouts", "Layouts", "fit"),
           ("elastic.control.controller", "Controller", "_boundary"),
           ("elastic.control.worker_group", "WorkerGroup", "start_segment"),
           ("elastic.control.worker_group", "WorkerGroup", "restore_from_peers"),
           ("elastic.control.calls", "WorkerCalls", "leave"),
           ("elastic.control.calls", "WorkerCalls", "progress"),
           ("elastic.control.calls", "WorkerCalls", "held_keys"),
           ("elastic.control.worker_group", "WorkerGroup", "wind_down"),
           ("elastic.control.worker_group", "WorkerGroup", "survivors"),
           ("elastic.control.worker_group", "WorkerGroup", "try_place"),
           ("elastic.control.checkpoints", "CheckpointTracker", "restore_newest"))


def _trace_controller(spans: list[tuple[str, float, float]],
                      leaves: list[tuple[float, Any]] | None = None) -> None:
    """Time the controller's recovery steps from the outside (wrappers on the class, in this
    process only; nothing in elastic/ is changed); ``leaves``: what each ``leave`` returned
    (the workers' own timings of their leave), with its start."""
    import functools
    import importlib

    for mod, cls_name, name in _TRACED:
        cls = getattr(importlib.import_module(mod), cls_name)
        orig = getattr(cls, name)

        def wrap(orig: Any = orig, name: str = name) -> Any:
            @functools.wraps(orig)
            def inner(self: Any, *a: Any, **kw: Any) -> Any:
                t0 = time.time()
                try:
                    out = orig(self, *a, **kw)
                    if name in ("leave", "restore_from_peers") and leaves is not None:
                        leaves.append((t0, [dict(o, call=name) for o in out or ()]))
                    return out
                finally:
                    spans.append((name, t0, time.time()))
            return inner

        setattr(cls, name, wrap())


def run_elastic(args: argparse.Namespace) -> dict[str, Any]:
    import elastic

    out = args.out
    spans: list[tuple[str, float, float]] = []
    leaves: list[tuple[float, Any]] = []
    _trace_controller(spans, leaves)
    model, dataset, loss, g = rc.workload(args.family)
    n = args.workers
    handle = elastic.submit(
        model=model, optimizer=dict(rc.OPTIM), loss=loss,
        dataset=dataset, global_batch_size=g, max_steps=args.steps, seed=rc.SEED,
        num_workers=n, min_workers=n - 1, max_workers=n, checkpoint_uri=os.path.join(out, "ckpt"),
        checkpoint_every=args.every, replacement_timeout_s=args.replacement_timeout,
        hang_timeout_s=30, scale_check_s=2.0, view="none", run_dir=os.path.join(out, "run"),
        name="recov", ray_address=args.address, strategy=args.strategy,
        peer_copies_every=args.peer_copies_every)
    ctl = handle.controller
    t0 = time.time()
    while handle.status()["step"] < args.kill_step:
        if handle.done():
            handle.result()
        if time.time() - t0 > 300:
            raise TimeoutError("elastic never reached the kill step")
        time.sleep(0.005)
    meta: dict[str, Any] = {"system": "elastic", "kill_at_status_step": handle.status()["step"],
                            "generation_before": ctl.generation}
    by_rank = {w.rank: w for w in ctl.workers}
    meta["pids_before"] = {r: w.info["pid"] for r, w in by_rank.items()}
    k = args.kill_rank
    meta["killed_rank"] = k
    meta["killed_node"] = by_rank[k].info["node_id"]
    meta["survivor_pids_before"] = [w.info["pid"] for r, w in by_rank.items() if r != k]
    ray_dead: dict[str, float] = {}

    def watch_ray() -> None:  # Ray's own view: when the GCS marks the node dead
        import ray

        while "t" not in ray_dead and time.time() - t0 < args.timeout:
            try:
                if any(n["NodeID"] == meta["killed_node"] and not n["Alive"]
                       for n in ray.nodes()):
                    ray_dead["t"] = time.time()
            except Exception:  # noqa: BLE001 - the GCS busy
                pass
            time.sleep(0.02)

    t_rm = _ask_kill(out, meta)["t_remove"]
    threading.Thread(target=watch_ray, daemon=True).start()
    res = handle.result(timeout=args.timeout)
    hist = res.history
    evs = [{"kind": e.kind, "message": e.message, "step": e.step, "time": e.time,
            "data": e.data} for e in res.events]
    fail = next(e for e in evs if e["kind"] == "failure" and e["time"] >= t_rm)
    rec = next(e for e in evs if e["kind"] == "recovered" and e["time"] >= t_rm)
    gen = meta["generation_before"]
    after = [h for h in hist if h["generation"] > gen and "note" not in h]
    before = [h for h in hist if h["time"] < t_rm and "note" not in h]
    return {**meta, "events": evs, "status": res.status,
            "t_noticed": fail["time"] - fail["data"]["detect_s"],
            "noticed_by": fail["data"].get("noticed_by", ""),
            "t_ray_node_dead": ray_dead.get("t"),
            "t_failure_event": fail["time"], "t_recovered": rec["time"],
            "recovered": rec["data"], "failure": fail["data"],
            "t_first_step_after": after[0]["time"] if after else None,
            "first_step_after": after[0]["step"] if after else None,
            "world_after": after[0]["world_size"] if after else None,
            "last_step_before": before[-1]["step"] if before else None,
            "steps_done": len(hist), "final_world": hist[-1]["world_size"],
            "pids_after": rec["data"]["pids"],
            "survivors_restarted": not set(meta["survivor_pids_before"]) <= set(
                rec["data"]["pids"]),
            "scaled": [e for e in evs if e["kind"] == "scaled"],
            "leaves": [(t - t_rm, out) for t, out in leaves if t >= t_rm],
            "spans": [(n, a, b - a) for n, a, b in spans
                      if b >= t_rm - 1 and (b - a > 0.05 or n not in ("_drain", "_poll_control"))]}


def _progress(prog: str) -> list[dict[str, Any]]:
    out = []
    if not os.path.isdir(prog):
        return out
    for fn in os.listdir(prog):
        if fn.endswith(".jsonl"):
            with open(os.path.join(prog, fn)) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    return sorted(out, key=lambda r: r["time"])


def run_raytrain(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = args.out
    ray.init(address=args.address, logging_level="ERROR")
    prog = os.path.join(out, "prog")
    os.makedirs(prog, exist_ok=True)
    workers: Any = (2, 3) if args.system == "raytrain-elastic" else 3
    meta: dict[str, Any] = {"system": args.system, "num_workers": workers}
    state: dict[str, Any] = {"survivor_exit": {}}

    def monitor() -> None:
        """Wait for the kill step, ask for the kill, then watch the survivors' processes."""
        try:
            t0 = time.time()
            while True:
                recs = _progress(prog)
                done = [r for r in recs if r["event"] == "step" and r["rank"] == 0]
                if done and done[-1]["step"] + 1 >= args.kill_step:
                    break
                if time.time() - t0 > 300:
                    raise TimeoutError("Ray Train never reached the kill step")
                time.sleep(0.005)
            cur = {r["rank"]: r for r in recs if r["event"] == "start"}  # latest per rank
            meta["kill_at_rank0_step"] = done[-1]["step"] + 1
            meta["pids_before"] = {r: s["pid"] for r, s in cur.items()}
            meta["killed_rank"] = 1
            meta["killed_node"] = cur[1]["node_id"]
            meta["survivor_pids_before"] = [s["pid"] for r, s in cur.items() if r != 1]
            meta["t_remove"] = _ask_kill(out, meta)["t_remove"]
            alive = set(meta["survivor_pids_before"])
            while alive and time.time() - meta["t_remove"] < args.timeout:
                for p in list(alive):
                    if not os.path.exists(f"/proc/{p}"):
                        state["survivor_exit"][p] = time.time()
                        alive.discard(p)
                time.sleep(0.02)
        except Exception:
            state["monitor_error"] = traceback.format_exc()

    th = threading.Thread(target=monitor, daemon=True)
    th.start()
    trainer = TorchTrainer(
        rc.raytrain_loop,
        train_loop_config={"prog_dir": prog, "steps": args.steps, "every": args.every},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.join(out, "rt-storage"), name="recov",
                             failure_config=FailureConfig(max_failures=3)),
    )
    t_fit = time.time()
    status, err = "finished", ""
    try:
        trainer.fit()
    except Exception as e:
        status, err = "failed", f"{type(e).__name__}: {e}"[:500]
    t_end = time.time()
    th.join(timeout=2)
    recs = _progress(prog)
    if "t_remove" not in meta:
        return {**meta, "status": status if status != "finished" else "no kill",
                "error": err or state.get("monitor_error", "no kill"), "t_fit": t_fit,
                "t_end": t_end}
    t_rm = meta["t_remove"]
    old = set(meta["pids_before"].values())
    new_starts = [r for r in recs if r["event"] == "start" and r["time"] > t_rm]
    new_pids = {r["pid"] for r in new_starts}
    steps_after = [r for r in recs if r["event"] == "step" and r["time"] > t_rm
                   and r["pid"] in new_pids]
    steps_before = [r for r in recs if r["event"] == "step" and r["time"] <= t_rm]
    errors = [r for r in recs if r["event"] == "error" and r["time"] > t_rm]
    exits = state["survivor_exit"]
    first_after = next((r for r in steps_after if r["rank"] == 0), None)
    return {**meta, "status": status, "error": err, "t_fit": t_fit, "t_end": t_end,
            "t_first_error": errors[0]["time"] if errors else None,
            "first_error": errors[0]["msg"] if errors else None,
            "t_survivor_exit_first": min(exits.values()) if exits else None,
            "t_restart": min((r["time"] for r in new_starts), default=None),
            "world_after": new_starts[0]["world"] if new_starts else None,
            "resume_step": min((r["resume_step"] for r in new_starts), default=None),
            "last_step_before": max((r["step"] for r in steps_before), default=None),
            "t_first_step_after": first_after["time"] if first_after else None,
            "first_step_after": first_after["step"] if first_after else None,
            "pids_after": sorted(new_pids),
            "survivors_restarted": bool(new_pids) and not (old & new_pids),
            "attempts": len([r for r in recs if r["event"] == "start" and r["rank"] == 0]),
            "checkpoints_before_kill": sorted({r["step"] for r in recs
                                               if r["event"] == "checkpoint"
                                               and r["time"] <= t_rm}),
            "steps_done": max((r["step"] for r in recs if r["event"] == "step"),
                              default=-1) + 1}


def driver(args: argparse.Namespace) -> None:
    t0 = time.time()
    res: dict[str, Any] = {}
    try:
        res.update(run_elastic(args) if args.system == "elastic" else run_raytrain(args))
    except Exception:
        res["status"] = "error"
        res["error"] = traceback.format_exc()[-3000:]
    res["driver_wall_s"] = time.time() - t0
    _write(os.path.join(args.out, "result.json"), res)
    sys.stdout.flush()
    os._exit(0)  # do not wait for Ray Train's or Ray's lingering threads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["elastic", "raytrain", "raytrain-elastic"])
    ap.add_argument("out")
    ap.add_argument("--driver", action="store_true", help="internal: the driver process")
    ap.add_argument("--address", help="internal: the cluster's address (driver)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--kill-step", type=int, default=25)
    ap.add_argument("--replacement", action="store_true")
    ap.add_argument("--replacement-timeout", type=float, default=5.0)
    ap.add_argument("--replacement-nice", type=int, default=0,
                    help="start the replacement node's processes at this niceness")
    ap.add_argument("--strategy", default="dp", help="elastic's layout (Ray Train: DDP)")
    ap.add_argument("--peer-copies-every", type=int, default=0)
    ap.add_argument("--family", default="recov", help="elastic's workload (rc.workload)")
    ap.add_argument("--workers", type=int, default=3, help="nodes of 1 CPU, one worker each")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    if args.driver:
        driver(args)
    else:
        owner(args)


if __name__ == "__main__":
    main()
