"""Step times of one plain job, step by step: does the host have slow phases, and where?

A planner family (bench/_planner_models.py) runs ``--steps`` steps under one named strategy
(or ``auto``) through ``elastic.submit``; printed: every step's milliseconds, then the medians
of 10-step windows against the run's median, and the phases where a window is at least
``--slow`` times it. On the 2-core CI VM three 120-step runs of mixer on 2 workers (2026-12-05)
each had phases 1.3-1.8x slower for 10-40 steps, at places that moved from run to run: what
the profiler's trial steps run in rotation against (docs/cost-model.md, the live profiler).

    python bench/step_trace.py --family mixer --workers 2 --strategy dp --steps 120

A benchmark, not a test: it never fails on a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _planner_models as pm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="mixer", choices=sorted(pm.ALL))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--strategy", default="dp")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--slow", type=float, default=1.3, help="a window this much over the "
                    "run's median is a slow phase")
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(  # the workers import the bench's families
        [BENCH, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    import elastic

    fam = pm.ALL[args.family]
    with tempfile.TemporaryDirectory(prefix="step-trace-") as tmp:
        handle = elastic.submit(
            model=fam.model, optimizer={"name": "adam", "lr": 1e-3}, loss=fam.loss,
            dataset=fam.dataset, global_batch_size=fam.global_batch, num_workers=args.workers,
            strategy=args.strategy, view="none", run_dir=tmp, name="step-trace",
            max_steps=args.steps, replan_every=0, hang_timeout_s=300)
        hist = list(handle.result(timeout=1800).history)
    ms = [h["step_time"] * 1e3 for h in hist if h.get("step_time")]
    print(" ".join(f"{h['step']}:{h['step_time'] * 1e3:.0f}" for h in hist))
    med = statistics.median(ms)
    windows = [statistics.median(ms[i:i + 10]) for i in range(0, len(ms) - 9, 10)]
    print(f"median {med:.1f} ms; 10-step windows / median: "
          + " ".join(f"{w / med:.2f}" for w in windows))
    slow = [i * 10 for i, w in enumerate(windows) if w >= args.slow * med]
    print(f"slow phases (windows >= {args.slow}x): "
          + (", ".join(f"steps {s}-{s + 9}" for s in slow) if slow else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
