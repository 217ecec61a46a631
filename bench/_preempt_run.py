"""One run of bench/preemption.py: a fresh ``ray.cluster_utils.Cluster`` (a head with 0 CPUs
and fast health checks, plus 3 worker nodes of 1 CPU), one training system on it, and a
preemption: once ``--drain-step`` steps are done, the node hosting rank 1 is drained through
Ray's own drain path (the GCS ``DrainNode`` call of ``ray drain-node``: reason
``DRAIN_NODE_REASON_PREEMPTION``, a deadline ``--deadline`` seconds on), removed at its
deadline, and a fresh 1-CPU node added right after (a fixed-size Ray Train job needs it).

    python bench/_preempt_run.py SYSTEM OUT_DIR --steps 260 --drain-step 30 --deadline 10

Two processes as in bench/_recov_run.py: this one owns the cluster (drains, removes, adds,
writes ``owner.json``); the driver (``--driver``) runs the system, asks for the drain with
``drain.json`` and writes ``result.json``. Before the drain, elastic also times two live
switches of the same state (zero3 -> zero2 -> zero3), the yardstick of its evacuation pause.
"""

from __future__ import annotations

import argparse
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
from _recov_run import _progress, _read, _write  # noqa: E402


def drain(address: str, node_id: str, deadline_s: float, why: str) -> float:
    """Ray's drain of a preempted node, as ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`` makes it; returns the
    deadline (seconds since the epoch)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline = time.time() + deadline_s
    gcs = ray._raylet.GcsClient(address=address)
    ok, msg = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(
        "DRAIN_NODE_REASON_PREEMPTION"), why, int(deadline * 1000))
    if not ok:
        raise RuntimeError(f"drain refused: {msg}")
    return deadline


# ---------------------------------------------------------------------------------- owner


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
        nodes = [cluster.add_node(num_cpus=1) for _ in range(args.workers)]
        cluster.wait_for_nodes()
        info["cluster_startup_s"] = time.time() - t0
        cmd = [sys.executable, os.path.abspath(__file__), args.system, out, "--driver",
               "--address", cluster.address, "--steps", str(args.steps), "--drain-step",
               str(args.drain_step), "--deadline", str(args.deadline), "--timeout",
               str(args.timeout), "--family", args.family, "--workers", str(args.workers)]
        proc = subprocess.Popen(cmd)
        ask = None
        until = time.time() + 400
        while ask is None and proc.poll() is None and time.time() < until:
            ask = _read(os.path.join(out, "drain.json"))
            if ask is None:
                time.sleep(0.005)
        if ask is None:
            info["error"] = "the driver never asked for the drain"
        else:
            node = next(n for n in nodes if n.node_id == ask["node_id"])
            info["t_drain"] = time.time()
            info["t_deadline"] = drain(cluster.address, node.node_id, args.deadline,
                                       "spot instance reclaimed (bench)")
            info["t_drained"] = time.time()
            _write(os.path.join(out, "owner.json"), info)
            while time.time() < info["t_deadline"]:
                time.sleep(0.005)
            info["t_remove"] = time.time()
            cluster.remove_node(node, allow_graceful=False)
            info["t_removed"] = time.time()
            _write(os.path.join(out, "owner.json"), info)
            try:
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
            except Exception as e:
                info["replacement_error"] = f"{type(e).__name__}: {e}"
            info["t_node_added"] = time.time()
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


def _ask_drain(out: str, node_id: str) -> dict[str, Any]:
    _write(os.path.join(out, "drain.json"), {"node_id": node_id, "time": time.time()})
    until = time.time() + 60
    while time.time() < until:
        o = _read(os.path.join(out, "owner.json"))
        if o and "t_drained" in o:
            return o
        time.sleep(0.005)
    raise TimeoutError("the owner never drained the node")


def run_elastic(args: argparse.Namespace) -> dict[str, Any]:
    import elastic

    out = args.out
    model, dataset, loss, g = rc.workload(args.family)
    n = args.workers
    handle = elastic.submit(
        model=model, optimizer=dict(rc.OPTIM), loss=loss,
        dataset=dataset, global_batch_size=g, max_steps=args.steps, seed=rc.SEED,
        strategy="zero3", num_workers=n, min_workers=n - 1, max_workers=n,
        checkpoint_uri=os.path.join(out, "ckpt"), checkpoint_every=10, hang_timeout_s=30,
        scale_check_s=2.0, view="none", run_dir=os.path.join(out, "run"), name="preempt",
        ray_address=args.address)
    ctl = handle.controller

    def wait_step(n: int) -> None:
        t0 = time.time()
        while handle.status()["step"] < n:
            if handle.done():
                handle.result()
            if time.time() - t0 > 300:
                raise TimeoutError(f"elastic never reached step {n}")
            time.sleep(0.005)

    wait_step(max(2, args.drain_step // 2))
    switches = []
    for target in ("zero2", "zero3"):  # the yardstick: a live switch of the same state
        t0 = time.time()
        handle.switch(target)
        switches.append(time.time() - t0)
    wait_step(args.drain_step)
    polls = []  # the notice poll the controller runs every drain_poll_s: its cost per call
    for _ in range(50):
        t0 = time.perf_counter()
        ctl.group.notices()
        polls.append(time.perf_counter() - t0)
    by_rank = {w.rank: w for w in ctl.workers}
    meta: dict[str, Any] = {"system": "elastic", "drain_at_status_step": handle.status()["step"],
                            "drained_rank": 1, "drained_node": by_rank[1].info["node_id"],
                            "survivor_pids_before": [w.info["pid"] for r, w in by_rank.items()
                                                     if r != 1],
                            "generation_before": ctl.generation, "switch_wall_s": switches,
                            "notice_poll_ms": 1e3 * sorted(polls)[len(polls) // 2]}
    own = _ask_drain(out, meta["drained_node"])
    res = handle.result(timeout=args.timeout)
    evs = [{"kind": e.kind, "message": e.message, "step": e.step, "time": e.time,
            "data": e.data} for e in res.events]
    own = _read(os.path.join(out, "owner.json")) or own
    hist = [h for h in res.history if "note" not in h]
    t_rm = own.get("t_removed", own["t_deadline"])
    after = [h for h in hist if h["time"] > t_rm]
    before_drain = [h for h in hist if h["time"] <= own["t_drain"]]
    gen = meta["generation_before"]
    old_gen = [h for h in hist if h["generation"] == gen]
    new_gen = [h for h in hist if h["generation"] > gen]
    return {**meta, "status": res.status, "events": evs,
            "switch_event_s": [e["data"].get("seconds") for e in evs if e["kind"] == "switch"],
            "notice": next((e for e in evs if e["kind"] == "preemption_notice"), None),
            "evacuating": next((e for e in evs if e["kind"] == "evacuating"), None),
            "evacuated": next((e for e in evs if e["kind"] == "evacuated"), None),
            "recovered": [e for e in evs if e["kind"] == "recovered"],
            "scaled": [e for e in evs if e["kind"] == "scaled"],
            "t_first_step_after_removed": after[0]["time"] if after else None,
            "t_last_old_step": old_gen[-1]["time"] if old_gen else None,
            "last_old_step": old_gen[-1]["step"] if old_gen else None,
            "t_first_new_step": new_gen[0]["time"] if new_gen else None,
            "first_new_step": new_gen[0]["step"] if new_gen else None,
            "last_step_before_drain": before_drain[-1]["step"] if before_drain else None,
            "step_time_median": sorted(h["step_time"] for h in hist)[len(hist) // 2],
            "steps_done": len(hist), "final_world": hist[-1]["world_size"]}


def run_raytrain(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = args.out
    ray.init(address=args.address, logging_level="ERROR")
    prog = os.path.join(out, "prog")
    os.makedirs(prog, exist_ok=True)
    meta: dict[str, Any] = {"system": "raytrain"}

    def monitor() -> None:
        try:
            t0 = time.time()
            while True:
                recs = _progress(prog)
                done = [r for r in recs if r["event"] == "step" and r["rank"] == 0]
                if done and done[-1]["step"] + 1 >= args.drain_step:
                    break
                if time.time() - t0 > 300:
                    raise TimeoutError("Ray Train never reached the drain step")
                time.sleep(0.005)
            cur = {r["rank"]: r for r in recs if r["event"] == "start"}
            meta["pids_before"] = {r: s["pid"] for r, s in cur.items()}
            meta["drained_node"] = cur[1]["node_id"]
            _ask_drain(out, meta["drained_node"])
        except Exception:
            meta["monitor_error"] = traceback.format_exc()

    th = threading.Thread(target=monitor, daemon=True)
    th.start()
    trainer = TorchTrainer(
        rc.raytrain_preempt_loop,
        train_loop_config={"prog_dir": prog, "steps": args.steps, "every": 10},
        scaling_config=ScalingConfig(num_workers=3, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.join(out, "rt-storage"), name="preempt",
                             failure_config=FailureConfig(max_failures=3,
                                                          max_preemption_failures=-1)),
    )
    status, err = "finished", ""
    try:
        trainer.fit()
    except Exception as e:
        status, err = "failed", f"{type(e).__name__}: {e}"[:500]
    th.join(timeout=2)
    recs = _progress(prog)
    own = _read(os.path.join(out, "owner.json")) or {}
    if "t_drain" not in own:
        return {**meta, "status": status if status != "finished" else "no drain",
                "error": err or meta.get("monitor_error", "no drain")}
    t_rm = own.get("t_removed", own["t_deadline"])
    old = set(meta["pids_before"].values())
    new_starts = [r for r in recs if r["event"] == "start" and r["time"] > own["t_drain"]]
    new_pids = {r["pid"] for r in new_starts}
    old_steps = [r for r in recs if r["event"] == "step" and r["pid"] in old and r["rank"] == 0]
    new_steps = [r for r in recs if r["event"] == "step" and r["pid"] in new_pids
                 and r["rank"] == 0]
    notices = [r for r in recs if r["event"] == "notice"]
    ckpts = [r for r in recs if r["event"] == "checkpoint" and r["rank"] == 0
             and r["time"] > own["t_drain"]]
    step_times = [b["time"] - a["time"] for a, b in zip(old_steps, old_steps[1:], strict=False)
                  if b["step"] == a["step"] + 1]
    return {**meta, "status": status, "error": err,
            "t_notice_seen": min((r["time"] for r in notices), default=None),
            "jit_checkpoints": [(r["step"], r["why"], r["time"]) for r in ckpts],
            "t_last_old_step": old_steps[-1]["time"] if old_steps else None,
            "last_old_step": old_steps[-1]["step"] if old_steps else None,
            "t_restart": min((r["time"] for r in new_starts), default=None),
            "resume_step": min((r["resume_step"] for r in new_starts), default=None),
            "t_first_step_after_removed": next((r["time"] for r in new_steps
                                                if r["time"] > t_rm), None),
            "t_first_new_step": next((r["time"] for r in new_steps
                                      if old_steps and r["step"] > old_steps[-1]["step"]),
                                     None),
            "step_time_median": sorted(step_times)[len(step_times) // 2] if step_times else None,
            "processes_restarted": len(new_pids),
            "survivors_restarted": bool(new_pids) and not (old & new_pids),
            "steps_done": max((r["step"] for r in recs if r["event"] == "step"), default=-1) + 1}


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
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["elastic", "raytrain"])
    ap.add_argument("out")
    ap.add_argument("--driver", action="store_true", help="internal: the driver process")
    ap.add_argument("--address", help="internal: the cluster's address (driver)")
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--drain-step", type=int, default=30)
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--family", default="recov", help="elastic's workload (rc.workload)")
    ap.add_argument("--workers", type=int, default=3, help="nodes of 1 CPU, one worker each")
    args = ap.parse_args()
    if args.driver:
        driver(args)
    else:
        owner(args)


if __name__ == "__main__":
    main()
