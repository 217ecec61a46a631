"""Warm workers benchmark: the time from submitting a job to its first completed step, cold
(each job starts its own worker processes) against warm (an ``elastic.WorkerPool`` hands the
same processes from job to job), side by side in one run, on one local Ray.

Two workloads, each run cold and warm:

* ``2-worker job``: one job of ``--steps`` steps on 2 workers, for two models of the
  product's own (``elastic.models``): the tiny MLP on ``SyntheticRegression`` and TinyGPT
  (4 layers, 0.47M parameters) on the demo corpus;
* ``sweep``: ``--trials`` short trials of the MLP in a row (as a sweep's sequential trials),
  each a different learning rate, 2 workers each.

Reported per job: seconds from ``fit()`` to the first completed step (what ``on_step``
sees), the whole job's seconds, and for every job its largest parameter difference from
the single-process reference (``elastic.reference.reference_train``), cold and warm: warm workers must not
change what a job trains (the MLP's must be < 1e-5; TinyGPT's differs from its
single-process run by the same amount cold and warm: float32 sums in another order, which
Adam amplifies where gradients are near zero). Ratios are cold / warm. The pool is
started (and waited for) before the warm jobs: its start is reported apart, as a scheduler
or a sweep pays it once.

A benchmark, not a test: it checks nothing. From the repository root:
``python bench/warm.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import elastic  # noqa: E402 - after the path set-up above
from elastic.models import SyntheticRegression, demo_dataset, gpt, gpt_loss, mlp_loss, tiny_mlp  # noqa: E402
from elastic.reference import reference_train  # noqa: E402


def _adam(params: Any, lr: float = 1e-2) -> Any:
    import torch

    return torch.optim.Adam(params, lr=lr)


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _job(tag: str, root: str, pool: Any, steps: int, model: Any, loss: Any, data: Any,
         batch: int, lr: float = 1e-2) -> dict[str, Any]:
    t0 = time.perf_counter()
    first: list[float] = []

    def on_step(entry: dict[str, Any]) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    res = elastic.fit(model=model, optimizer=functools.partial(_adam, lr=lr), loss=loss,
                      dataset=data, global_batch_size=batch, max_steps=steps, num_workers=2,
                      view="none", run_dir=os.path.join(root, f"{tag}-{time.time_ns()}"),
                      on_step=on_step, pool=pool)
    total = time.perf_counter() - t0
    placed = next(e for e in res.events if e.kind == "placed")
    return {"first_s": first[0], "total_s": total, "warm": placed.data.get("warm", 0),
            "state": res.state_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2, help="2-worker jobs per model and mode")
    a = ap.parse_args()
    import ray

    root = tempfile.mkdtemp(prefix="elastic-warm-bench-")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    mlp_data, text = SyntheticRegression(n=1024), demo_dataset(block_size=32)
    models = {"mlp": (tiny_mlp, mlp_loss, mlp_data, 32),
              "tinygpt": (functools.partial(gpt, block_size=32), gpt_loss, text, 8)}
    refs = {name: reference_train(m, functools.partial(_adam, lr=1e-2), lo, d, b, a.steps,
                                  seed=0)[0] for name, (m, lo, d, b) in models.items()}
    lrs = [10 ** (-1.5 - 0.25 * i) for i in range(a.trials)]
    sweep_refs = [reference_train(tiny_mlp, functools.partial(_adam, lr=lr), mlp_loss, mlp_data,
                                  32, a.steps, seed=0)[0] for lr in lrs]
    rows: list[tuple[str, str, dict[str, Any], float]] = []

    def run(mode: str, pool: Any) -> None:
        for name, (m, lo, d, b) in models.items():
            for i in range(a.repeat):
                r = _job(f"{mode}-{name}-{i}", root, pool, a.steps, m, lo, d, b)
                rows.append((f"2-worker {name} #{i + 1}", mode, r, _max_diff(r["state"], refs[name])))
        for i, lr in enumerate(lrs):
            r = _job(f"{mode}-trial-{i}", root, pool, a.steps, tiny_mlp, mlp_loss, mlp_data, 32, lr)
            rows.append((f"sweep trial {i + 1} (lr {lr:.4f})", mode, r, _max_diff(r["state"], sweep_refs[i])))

    t = time.perf_counter()
    run("cold", None)
    cold_all = time.perf_counter() - t
    t = time.perf_counter()
    pool = elastic.WorkerPool(2)
    pool_s = time.perf_counter() - t
    t = time.perf_counter()
    run("warm", pool)
    warm_all = time.perf_counter() - t
    info = pool.info()
    pool.close()
    ray.shutdown()

    print(f"\nwarm workers: submit -> first completed step, 2 workers, {a.steps} steps per job "
          f"(pool of 2 started in {pool_s:.2f}s, once)\n")
    print(f"{'job':<28}{'cold first':>11}{'warm first':>11}{'ratio':>8}{'cold job':>10}"
          f"{'warm job':>10}{'warm/2':>8}{'max|diff| cold':>16}{'max|diff| warm':>16}")
    cold = {n: r for n, mode, r, _ in rows if mode == "cold"}
    cold_diff = {n: d for n, mode, _, d in rows if mode == "cold"}
    for n, mode, r, diff in rows:
        if mode != "warm":
            continue
        c = cold[n]
        print(f"{n:<28}{c['first_s']:>10.2f}s{r['first_s']:>10.2f}s{c['first_s'] / r['first_s']:>7.1f}x"
              f"{c['total_s']:>9.2f}s{r['total_s']:>9.2f}s{r['warm']:>8}{cold_diff[n]:>16.1e}"
              f"{diff:>16.1e}")
    warm_first = [r["first_s"] for _, mode, r, _ in rows if mode == "warm"]
    cold_first = [r["first_s"] for _, mode, r, _ in rows if mode == "cold"]
    sweep = [(cold[n]["total_s"], r["total_s"]) for n, mode, r, _ in rows
             if mode == "warm" and n.startswith("sweep")]
    print(f"\nfirst step, median: cold {statistics.median(cold_first):.2f}s, warm "
          f"{statistics.median(warm_first):.2f}s ({statistics.median(cold_first) / statistics.median(warm_first):.1f}x); "
          f"warm worst {max(warm_first):.2f}s (goal < 2 s: {'met' if max(warm_first) < 2 else 'NOT met'})")
    print(f"sweep of {a.trials} trials: cold {sum(c for c, _ in sweep):.1f}s, warm "
          f"{sum(w for _, w in sweep):.1f}s ({sum(c for c, _ in sweep) / sum(w for _, w in sweep):.1f}x)")
    print(f"all jobs: cold {cold_all:.1f}s, warm {warm_all:.1f}s + pool start {pool_s:.1f}s")
    print(f"max |diff| from the single-process reference, every warm job: "
          f"{max(d for _, mode, _, d in rows if mode == 'warm'):.1e}; pool: {info}")


if __name__ == "__main__":
    main()
