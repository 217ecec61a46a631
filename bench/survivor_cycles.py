"""Survivor cycles without Ray (issue 13, 5): the reproduction of the survivors' crash.

Two long-lived survivor processes (the real ``Worker``, its calls on a 2-thread pool like a
threaded Ray actor) go through node-loss cycles: a generation of 3 ranks (the survivors and a
fresh victim), the victim SIGKILLed at a random moment (0.3-2.5 s), the survivors' step
fails, they ``leave()``, join a new generation of 2 ranks, ``restart_fresh`` (from scratch, in
the same processes) and train a random number of steps; repeat. Beside each segment a side
thread makes the controller's second-thread calls (``drain``, ``memory_counts``) every
``SIDE_MS`` ms (default 2; ``SIDE=0`` turns it off). Prints a JSON record: cycles done and
survivor deaths (exit code, phase). Run it under glibc's debug malloc to make a late write
into freed memory crash early:

    MALLOC_CHECK_=3 MALLOC_PERTURB_=165 \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 PYTHONFAULTHANDLER=1 \
    PYTHONPATH=$PWD flock /tmp/elastic-ray.lock python bench/survivor_cycles.py 12 zero3 5

Before the fix (69097e5) a survivor died of SIGSEGV in the first cycle, twice (training
thread in ``optimizer.zero_grad``, side thread in ``sharded_counts``); with ``SIDE=0`` 80
cycles ran clean (docs/reliability.md).

usage: python bench/survivor_cycles.py CYCLES LAYOUT [SEED]   (LAYOUT: zero3, pipeline-zero2 ...)
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.mp_harness import free_port  # noqa: E402

TIMEOUT_S = 30.0


def _cfg(world):
    from elastic.config import JobConfig
    from tests.helpers import RegressionData, adam, mlp, mse
    return JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                     global_batch_size=12, max_steps=10**6, num_workers=3)


def _spec(layout, world):
    from elastic.data import even_shares
    from strategies import StrategySpec
    name, _, dp_mode = layout.partition("-")
    kw = {"pp_degree": 2, "micro_batches": 2, "dp_mode": dp_mode} if name == "pipeline" else {}
    return StrategySpec(name, world, shares=tuple(even_shares(12, world)), **kw)


def victim(port, rank, gen, layout, kill_after):
    torch.set_num_threads(1)
    from elastic.worker import Worker
    w = Worker(_cfg(3), 9, False, 1)
    w.join("127.0.0.1", port, rank, 3, gen, TIMEOUT_S)
    w.restart_fresh(_spec(layout, 3), None, 0)
    threading.Timer(kill_after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    w.run(0, 10**6)


def survivor(idx, tasks, results):
    torch.set_num_threads(1)
    from elastic.worker import Worker
    w = Worker(_cfg(3), idx, False, 1)
    pool = ThreadPoolExecutor(2)  # like a threaded actor: calls land on either thread
    call = lambda fn, *a: pool.submit(fn, *a).result()  # noqa: E731
    side_on = threading.Event()

    def side():  # the controller's drain + memory_counts on the second thread, during run
        while True:
            side_on.wait()
            try:
                w.drain()
                if w.layout.strategy is not None:
                    w.memory_counts()
            except Exception:  # noqa: BLE001 - Python-level races are not what we look for
                pass
            time.sleep(float(os.environ.get("SIDE_MS", "2")) / 1000)

    if os.environ.get("SIDE", "1") == "1":
        threading.Thread(target=side, daemon=True).start()

    def run(a, b):
        side_on.set()
        try:
            return call(w.run, a, b)
        finally:
            side_on.clear()
    while True:
        t = tasks.get()
        if t is None:
            return
        kind = t[0]
        try:
            if kind == "gen3":
                _, port, rank, gen, layout = t
                call(w.join, "127.0.0.1", port, rank, 3, gen, TIMEOUT_S)
                call(w.restart_fresh, _spec(layout, 3), None, 0)
                t0 = time.time()
                try:
                    run(0, 10**6)
                    results.put((idx, "gen3-finished?", None))
                    continue
                except Exception as e:  # the loss
                    err = type(e).__name__
                failed = time.time() - t0
                call(w.leave)
                results.put((idx, "left", (err, round(failed, 2))))
            elif kind == "gen2":
                _, port, rank, gen, layout, steps = t
                call(w.join, "127.0.0.1", port, rank, 2, gen, TIMEOUT_S)
                call(w.restart_fresh, _spec(layout, 2), None, 0)
                out = run(0, steps)
                results.put((idx, "trained", out["next_step"]))
        except Exception as e:  # noqa: BLE001
            results.put((idx, "error", f"{type(e).__name__}: {e}"[:300]))


def main():
    cycles = int(sys.argv[1])
    layout = sys.argv[2]
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue(), ctx.Queue()]
    results = ctx.Queue()
    procs = [ctx.Process(target=survivor, args=(i, tasks[i], results), daemon=True)
             for i in range(2)]
    for p in procs:
        p.start()
    gen = 0
    stats = {"cycles": 0, "deaths": [], "errors": []}
    t_start = time.time()
    try:
        for c in range(cycles):
            gen += 1
            port = free_port()
            vrank = rng.randrange(3)
            ranks = [r for r in range(3) if r != vrank]
            kill_after = rng.uniform(0.3, 2.5)
            v = ctx.Process(target=victim, args=(port, vrank, gen, layout, kill_after),
                            daemon=True)
            v.start()
            for i in range(2):
                tasks[i].put(("gen3", port, ranks[i], gen, layout))
            got = {}
            deadline = time.time() + 120
            while len(got) < 2 and time.time() < deadline:
                try:
                    idx, what, val = results.get(timeout=1)
                    got[idx] = (what, val)
                except Exception:
                    if any(not p.is_alive() for p in procs):
                        break
            v.join(5)
            if v.is_alive():
                v.kill()
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
            if dead or len(got) < 2 or any(w != "left" for w, _ in got.values()):
                stats["deaths" if dead else "errors"].append({"cycle": c, "phase": "gen3",
                                                              "dead": dead, "got": got})
                break
            gen += 1
            port = free_port()
            steps = rng.randint(5, 40)
            for i in range(2):
                tasks[i].put(("gen2", port, i, gen, layout, steps))
            got = {}
            deadline = time.time() + 120
            while len(got) < 2 and time.time() < deadline:
                try:
                    idx, what, val = results.get(timeout=1)
                    got[idx] = (what, val)
                except Exception:
                    if any(not p.is_alive() for p in procs):
                        break
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
            if dead or len(got) < 2 or any(w != "trained" for w, _ in got.values()):
                stats["deaths" if dead else "errors"].append({"cycle": c, "phase": "gen2",
                                                              "dead": dead, "got": got})
                break
            stats["cycles"] += 1
            if c % 10 == 0:
                print(f"cycle {c} ok ({time.time() - t_start:.0f}s)", flush=True)
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    stats["seconds"] = round(time.time() - t_start, 1)
    print(json.dumps(stats, default=str))


if __name__ == "__main__":
    main()
