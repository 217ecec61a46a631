"""Steady-state step rate of layouts side by side, outside Ray: N spawned gloo processes
(1 thread each) train the same model under each layout in turn, in alternating rounds, so
every layout sees the same machine load; prints samples/s per layout and the ratio to dp.

    python bench/step_rate.py --workers 2 --model mlp many --layouts dp dp-nohook zero1 zero2

Models: ``mlp`` is bench/strategies.py's workload (12 blocks of ``Linear(1024, 1024) + Tanh``,
12.6M parameters in 24 tensors, global batch 32); ``many`` has many small tensors, like the
MLP-Mixer of issue 16 (24 blocks of ``LayerNorm(64) + Linear(64, 128) + GELU + Linear(128,
64)``, 0.4M parameters in 144 tensors, global batch 64), where a layout's per-message cost
shows. Adam, MSE, seeded synthetic regression data. ``gpt`` is another model family:
elastic.models' TinyGPT (4 layers, n_embd 128, 0.82M parameters in 53 tensors) on the demo
corpus, 64-token blocks, global batch 32, cross entropy.

Layouts: any strategy name; ``dp-nohook`` is dp with DDP's built-in all-reduce instead of
``strategies.dp.recording_allreduce`` (the health hook, which also leaves out the built-in's
division and takes the gradient norm on CPU), to measure what the hook saves or costs;
``ddp-plain`` is a user's own DDP loop (``_PlainLoop``), to measure what elastic's dp step adds.

Each round builds every layout once (the order rotates round by round), runs ``--warmup``
steps, then times ``--steps`` steps between two barriers (rank 0's clock). A benchmark, not a
test: it never fails on a figure. Run it alone (the machine's other load moves every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != BENCH] + [BENCH]

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"global_batch": 32, "width": 1024},
    "many": {"global_batch": 64, "width": 64},
    "gpt": {"global_batch": 32, "width": 0},
}


def _model(name: str) -> Any:
    from torch import nn

    if name == "mlp":
        import _strat_common

        return _strat_common.model_factory()
    if name == "gpt":
        import _strat_common

        return _strat_common.gpt_factory()
    w = MODELS[name]["width"]
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.GELU(),
                                         nn.Linear(2 * w, w)) for _ in range(24)])


class _PlainLoop:
    """``ddp-plain``: a user's own loop, as torchrun's in bench/overhead.py (DDP with its
    defaults, zero_grad, forward, loss, backward, Adam step): what elastic's ``dp`` step adds
    beside it (the health hook, the gradient norm every step, running statistics, bucket
    views) shows in the ratio."""

    def __init__(self, model: Any, loss_fn: Any) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model)
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.loss_fn = loss_fn

    def train_step(self, x: Any, y: Any) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def close(self) -> None:
        pass


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import strategies.dp as dp_mod
    from elastic.data import StepSampler, even_shares, fetch_batch, share_bounds
    from elastic.models import SyntheticRegression, demo_dataset, gpt_loss
    from elastic.reference import build_model
    from strategies import Runtime, StrategySpec, get

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))

    class _PlainDDP(dp_mod.DDP):  # type: ignore[misc,name-defined]
        def register_comm_hook(self, state: object, hook: Any) -> None:
            return None  # DDP's built-in all-reduce

    results: dict[str, dict[str, list[float]]] = {}
    for model_name in args.model:
        g = MODELS[model_name]["global_batch"]
        w = MODELS[model_name]["width"]
        if model_name == "gpt":
            data: Any = demo_dataset(64)
            loss_fn: Any = gpt_loss
        else:
            data = SyntheticRegression(n=max(512, 4 * g), in_features=w, out_features=w, seed=0)
            loss_fn = F.mse_loss
        sampler = StepSampler(len(data), g, 0)
        shares = even_shares(g, world)
        lo, hi = share_bounds(shares, rank)
        per: dict[str, list[float]] = {lay: [] for lay in args.layouts}
        for rnd in range(args.rounds):
            k = rnd % len(args.layouts)
            for lay in args.layouts[k:] + args.layouts[:k]:
                if lay == "ddp-plain":
                    strat: Any = _PlainLoop(build_model(lambda mn=model_name: _model(mn), 0),
                                            loss_fn)
                else:
                    name = "dp" if lay == "dp-nohook" else lay
                    real = dp_mod.DDP
                    if lay == "dp-nohook":
                        dp_mod.DDP = _PlainDDP  # type: ignore[misc]
                    try:
                        spec = StrategySpec(name, world, shares)
                        model = build_model(lambda mn=model_name: _model(mn), 0)
                        strat = get(name)(spec, Runtime.current(), model,
                                          lambda p: torch.optim.Adam(p, lr=1e-4), loss_fn)
                        if lay == "dp-nohook":  # DDP's own hook divides by the world size
                            strat._scale *= world
                    finally:
                        dp_mod.DDP = real  # type: ignore[misc]
                for step in range(args.warmup + args.steps):
                    if step == args.warmup:
                        dist.barrier()
                        t0 = time.perf_counter()
                    x, y = fetch_batch(data, sampler.indices(step))
                    strat.train_step(x[lo:hi], y[lo:hi])
                dist.barrier()
                per[lay].append(g * args.steps / (time.perf_counter() - t0))
                strat.close()
        results[model_name] = per
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", nargs="+", default=["mlp", "many"], choices=sorted(MODELS))
    ap.add_argument("--layouts", nargs="+", default=["dp", "zero1", "zero2"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write every round's samples/s here")
    args = ap.parse_args()
    import _strat_common

    t0 = time.time()
    results = _strat_common.run_gloo_ranks(_rank, args.workers, args)
    print(f"{args.workers} gloo workers, {args.rounds} rounds x {args.steps} steps "
          f"({args.warmup} warm-up), {time.time() - t0:.0f} s")
    for model_name, per in results.items():
        print(f"\nmodel {model_name}: samples/s, median of rounds [per round], x dp")
        print("  (ratio: the median of the rounds' ratios, each layout against dp's figure "
              "of the same round)")
        for lay, xs in per.items():
            med = statistics.median(xs)
            ratio = (f"{statistics.median(x / d for x, d in zip(xs, per['dp'], strict=True)):.3f}"
                     if "dp" in per else "-")
            print(f"  {lay:10s} {med:8.1f}  [{', '.join(f'{x:.0f}' for x in xs)}]  {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
