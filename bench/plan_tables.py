"""Every candidate the planner weighs, as text: the check that a change meant to leave the
planner's answers alone (a speed-up, a refactor) does.

Prints, for every shipped example cluster (``clusters/examples``), a 7 B and a GPT-2-size
transformer, five batches, a fitted-looking cost model and measured speeds, each candidate's
plan, shares, split, step-time parts (as ``repr``), memory use, tightest rank, a digest of
its per-rank memory and its rejection text, then the explanation. Run it before and after a
change and compare: ``python bench/plan_tables.py > before.txt``, change,
``python bench/plan_tables.py > after.txt``, ``cmp before.txt after.txt``. Not a benchmark;
``--big`` adds the 10,000-GPU examples (minutes).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusters import CostModel, load_cluster, transformer_profile  # noqa: E402
from clusters.planner import plan  # noqa: E402

BIG = ("a100-10k", "mixed-10k", "five-pools-10k")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", action="store_true", help="the 10,000-GPU examples too")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(here, "clusters", "examples", "*.yaml")))
    profiles = [
        transformer_profile(layers=32, d_model=4096, n_heads=32, seq_len=2048, vocab=32000,
                            name="7b"),
        transformer_profile(layers=12, d_model=768, n_heads=12, seq_len=1024, vocab=50257,
                            name="gpt2"),
    ]
    fitted = CostModel(pipe_action_s=-2e-4, pipe_bubble_scale=0.8, pipe_msg_scale=0.5,
                       pipe_step_overhead=1e-3, pipe_update_scale=0.6, pipe_fit_reach=4.0,
                       sync_wait_s=3e-4)
    for f in files:
        name = os.path.basename(f)[:-5]
        if name in BIG and not args.big:
            continue
        c = load_cluster(f)
        measured = {c.devices[0].id: 50.0, c.devices[-1].id: 7.0}
        for p in profiles:
            for g, kw in ((64, {}), (512, {}), (2048, {}), (512, {"model": fitted}),
                          (256, {"speeds": measured})):
                r = plan(c, p, g, **kw)  # type: ignore[arg-type]
                for cand in r.ranked + r.rejected:
                    e, pl = cand.estimate, cand.plan
                    figures = None if e is None else (
                        repr(e.step_time), repr(e.compute), repr(e.comm), repr(e.optimizer),
                        repr(e.memory_use), e.tightest_rank, e.link, len(e.memory),
                        hashlib.md5(repr(e.memory).encode()).hexdigest())
                    print(name, p.name, g, sorted(kw), pl.label, pl.shares[:8],
                          len(pl.shares), pl.stage_split, figures, cand.rejection, pl.reason,
                          cand.subset, repr(cand.peak_fraction))
                print(r.explanation)


if __name__ == "__main__":
    main()
