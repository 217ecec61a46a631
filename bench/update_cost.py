"""What the optimizer's update and zero1's broadcasts cost inside a step, outside Ray: N
spawned gloo processes (1 thread each) train a planner family (bench/_planner_models.py)
under dp and zero1, each also without its update (the optimizer's step does nothing) and
zero1 without its broadcasts, in rounds; prints the median step of each and the update's
own step timed around ``optimizer.step()``.

    python bench/update_cost.py --family dlrm --workers 3

The update's cost inside a step is dp less "dp, no update"; timed alone it is "dp: update".
The profiler's trial measures the first (docs/cost-model.md, the live profiler). A
benchmark, not a test: it never fails on a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != BENCH] + [BENCH]

LAYOUTS = ("dp", "dp, no update", "zero1", "zero1, no update", "zero1, no broadcast")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from _strat_common import join_gloo_family

    import strategies.zero as zero
    from strategies import Runtime, StrategySpec, get

    fam, data, shares, lo = join_gloo_family(rank, world, port, args.family)
    g = fam.global_batch
    steps: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
    alone: dict[str, list[float]] = {}
    full_step = zero.ShardedUpdate.step

    def no_broadcast(self: Any) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    for _ in range(args.rounds):
        for lay in LAYOUTS:
            name = lay.split(",")[0]

            def factory(params: Any, lay: str = lay) -> Any:
                opt = torch.optim.Adam(params, lr=1e-4)
                real = opt.step
                if lay.endswith("no update"):
                    opt.step = lambda *a, **k: None
                else:
                    def timed(*a: Any, **k: Any) -> Any:
                        t0 = time.perf_counter()
                        r = real(*a, **k)
                        alone.setdefault(lay, []).append(time.perf_counter() - t0)
                        return r
                    opt.step = timed
                return opt

            if lay.endswith("no broadcast"):
                zero.ShardedUpdate.step = no_broadcast  # type: ignore[method-assign]
            torch.manual_seed(0)
            strat = get(name)(StrategySpec(name, world, tuple(shares)), Runtime.current(),
                              fam.model(), factory, fam.loss)
            try:
                for step in range(args.warmup + args.steps):
                    start = (step * g) % (len(data) - g)
                    xs, ys = zip(*(data[i] for i in range(start, start + g)), strict=True)
                    hi = lo + shares[rank]
                    x, y = torch.stack(xs)[lo:hi], torch.stack(ys)[lo:hi]
                    dist.barrier()
                    t0 = time.perf_counter()
                    strat.train_step(x, y)
                    dist.barrier()
                    if step >= args.warmup:
                        steps[lay].append(time.perf_counter() - t0)
            finally:
                strat.close()
                zero.ShardedUpdate.step = full_step  # type: ignore[method-assign]
    if rank == 0:
        out.put({"steps": {k: statistics.median(v) for k, v in steps.items()},
                 "alone": {k: statistics.median(v) for k, v in alone.items()}})
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="dlrm")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import _strat_common

    t0 = time.time()
    res = _strat_common.run_gloo_ranks(_rank, args.workers, args, timeout_s=1800)
    print(f"{args.family}, {args.workers} gloo workers, {args.rounds} rounds x {args.steps} "
          f"steps ({args.warmup} warm-up), {time.time() - t0:.0f} s; median ms per step")
    for lay, s in res["steps"].items():
        print(f"  {lay:22s} {s * 1e3:7.2f}")
    for lay, s in res["alone"].items():
        print(f"  {lay + ': update':22s} {s * 1e3:7.2f}  (timed around its optimizer.step() call)")
    st = res["steps"]
    dp_alone = res["alone"].get("dp")
    inside = st["dp"] - st["dp, no update"]
    print(f"  update inside a dp step {inside * 1e3:.2f} ms"
          + (f" = {inside / dp_alone:.2f}x its optimizer.step() call" if dp_alone else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
