"""Memory for compute: activation checkpointing, gradient accumulation and bf16, side by side.

One fresh 2-worker dp job per setting (so each worker's peak RSS, VmHWM from /proc, belongs to
that setting alone), the same GPT and global batch: each worker's peak RSS, what the setting
saves against the plain job's peak (the step's activations; everything else is the same), and
the median step time over the steps after the first two, with ratios against plain. A
benchmark, not a test: figures go to docs/benchmarks.md.

    python bench/memory.py [--steps 12] [--block 256] [--layers 4] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._strat_common import code_version, proc_mem_mb  # noqa: E402

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("activation_checkpointing", {"activation_checkpointing": True}),
    ("micro_batch_size=4", {"micro_batch_size": 4}),
    ("both", {"activation_checkpointing": True, "micro_batch_size": 4}),
    ("bf16", {"precision": "bf16"}),
]


def run(name: str, kw: dict[str, Any], a: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import elastic

    model = {"target": "elastic.models:gpt", "block_size": a.block, "n_layer": a.layers,
             "n_embd": a.embd, "n_head": 4}
    handle = elastic.submit(
        model=model, optimizer={"name": "adamw", "lr": 1e-3}, loss="elastic.models:gpt_loss",
        dataset={"target": "elastic.models:demo_dataset", "block_size": a.block},
        global_batch_size=a.batch, max_steps=a.steps, num_workers=2, strategy="dp",
        view="none", run_dir=os.path.join(tmp, name), name=f"mem-{name.split('=')[0]}",
        seed=0, **kw)
    ctl = handle.controller
    peaks: list[float] = []
    t_end = time.time() + 900
    while not handle.done() and time.time() < t_end:
        pids = [w.info.get("pid") for w in ctl.workers if w.info.get("pid")]
        if pids and len(ctl.history) >= a.steps - 1:  # before the job ends and workers exit
            peaks = [proc_mem_mb(p)["hwm_mb"] for p in pids]
            break
        time.sleep(0.05)
    result = handle.result(timeout=900)
    times = [h["step_time"] for h in result.history[2:]]
    return {"setting": name, "peak_mb": peaks, "median_step_s": statistics.median(times), "final_loss": result.history[-1]["loss"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tmp = tempfile.mkdtemp(prefix="elastic-mem-")
    print(f"code {code_version()}; GPT block {a.block}, {a.layers} layers, n_embd {a.embd}, "
          f"G={a.batch} on 2 workers (dp), {a.steps} steps per setting", flush=True)
    rows = []
    try:
        for name, kw in SETTINGS:
            rows.append(run(name, kw, a, tmp))
            r = rows[-1]
            print(f"{name:26s} peak RSS {', '.join(f'{x:.0f}' for x in r['peak_mb'])} MB"
                  f"  median step {r['median_step_s'] * 1e3:.0f} ms  loss {r['final_loss']:.3f}",
                  flush=True)
    finally:
        ray.shutdown()
    plain = rows[0]
    p_peak = statistics.mean(plain["peak_mb"])
    print("\n| setting | peak RSS per worker (MB) | saved vs plain (MB) | median step (ms) "
          "| step vs plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {', '.join(f'{x:.0f}' for x in r['peak_mb'])} | "
              f"{p_peak - statistics.mean(r['peak_mb']):.0f} | {r['median_step_s'] * 1e3:.0f} | "
              f"{r['median_step_s'] / plain['median_step_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
