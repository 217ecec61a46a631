"""What buddy copies cost a running job: steady step time with ``peer_copies_every`` off and
at a few cadences, side by side in one run.

One fresh job per setting, the same model family (``bench/_planner_models.py``), layout,
world and global batch, on one local Ray; the settings are run in interleaved rounds, each
round starting at the next setting (off, k1, k2; k1, k2, off; ...), so that a drift of the
host's load, or of the run itself, falls on all of them alike.
Per setting: the mean step time over the steps after the first ``--skip`` (what the copies
cost in all: their snapshot at the boundary and the exchange on a background thread, which
shares the cores with the next steps), the median (a step without a copy), and both as
ratios to ``off``. Host memory the copies take is ``peer_copies_memory_gb``'s count, said in
docs/architecture.md (Peer redundancy). A benchmark, not a test: figures go to
docs/benchmarks.md.

    python bench/peer_copies.py [--family gpt] [--strategy zero3] [--workers 3] \\
        [--every 0 20 5] [--steps 60] [--rounds 2] [--model-kw rows=40000]

``--model-kw`` passes arguments to the family's model factory (a larger model: more state per
rank to copy).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._planner_models import FAMILIES  # noqa: E402
from bench._strat_common import code_version  # noqa: E402


def run(every: int, a: argparse.Namespace, tmp: str, tag: str) -> dict[str, Any]:
    import elastic

    fam = FAMILIES[a.family]
    result = elastic.fit(
        model=_model(a), optimizer={"name": "adam", "lr": 1e-3}, loss=fam.loss,
        dataset=fam.dataset(), global_batch_size=fam.global_batch, max_steps=a.steps,
        num_workers=a.workers, strategy=a.strategy, view="none", seed=0,
        peer_copies_every=every, run_dir=os.path.join(tmp, tag), name=f"copies-{tag}")
    times = [h["step_time"] for h in result.history[a.skip:]]
    off = [h.get("peer_copies_off") for h in result.history if h.get("peer_copies_off")]
    return {"every": every, "mean": statistics.mean(times), "median": statistics.median(times),
            "off_note": off[0] if off else None}


def _model(a: argparse.Namespace) -> Any:
    kw = {}
    for item in a.model_kw:
        key, _, val = item.partition("=")
        kw[key] = float(val) if "." in val else int(val)
    return functools.partial(FAMILIES[a.family].model, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="gpt", choices=sorted(FAMILIES))
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--every", type=int, nargs="+", default=[0, 20, 5])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-kw", nargs="*", default=[], metavar="KEY=VALUE",
                    help="arguments of the family's model factory (e.g. rows=40000 for dlrm)")
    a = ap.parse_args()
    if 0 not in a.every:
        a.every = [0, *a.every]
    import ray

    ray.init(address="local", num_cpus=max(4, a.workers), include_dashboard=False,
             logging_level="ERROR",
             log_to_driver=False)
    rows: dict[int, list[dict[str, Any]]] = {k: [] for k in a.every}
    with tempfile.TemporaryDirectory(prefix="bench-copies-") as tmp:
        for r in range(a.rounds):
            # each round starts at the next setting: jobs later in a run measured slower
            # (off: 270 -> 316 ms over three rounds), and a fixed order put that on the last
            order = a.every[r % len(a.every):] + a.every[:r % len(a.every)]
            for k in order:
                out = run(k, a, tmp, f"r{r}-k{k}")
                rows[k].append(out)
                print(f"round {r + 1}, every={k}: mean {out['mean'] * 1e3:.1f} ms, median "
                      f"{out['median'] * 1e3:.1f} ms"
                      + (f" (copies off: {out['off_note']})" if out["off_note"] else ""),
                      flush=True)
    ray.shutdown()
    base_mean = statistics.median(o["mean"] for o in rows[0])
    base_median = statistics.median(o["median"] for o in rows[0])
    params = sum(p.numel() for p in _model(a)().parameters())
    print(f"\n{a.family} {' '.join(a.model_kw)} ({params / 1e6:.2f}M parameters: "
          f"{params * 12 / 1e6 / a.workers:.0f} MB of fp32 state and Adam moments per rank "
          f"under zero3), {a.strategy}, {a.workers} workers, {a.steps} steps (first {a.skip} "
          f"left out), {a.rounds} round(s); code {code_version()}")
    print("| peer_copies_every | mean step (ms), per round | mean / off | median step (ms) "
          "| median / off |")
    print("|---|---|---|---|---|")
    for k in a.every:
        means = [o["mean"] for o in rows[k]]
        med = statistics.median(o["median"] for o in rows[k])
        print(f"| {k or 'off'} | {', '.join(f'{m * 1e3:.1f}' for m in means)} | "
              f"{statistics.median(means) / base_mean:.3f} | {med * 1e3:.1f} | "
              f"{med / base_median:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
