"""Where a live switch *through a gather* spends its time: the worker's ``_build`` phase by
phase, outside Ray. Historical: since 2026-12-01 a switch moves pieces instead
(``switch_move: reshard``, ``strategies.resharding``), which skips every phase below but the
build and the load; this profiles ``switch_move: gather`` as it was on 2026-11-29 (the
figures of docs/benchmarks.md at 2d38cfc of that day). bench/strategies.py times both moves.

    python bench/_strat_profile.py [--workers 2] [--rounds 1] [--json OUT]

Spawns ``--workers`` processes (1 thread each) forming a gloo group on 127.0.0.1, lays out the
``_strat_common`` model (~50 MB, Adam) and walks the same cycle of ordered strategy pairs as
bench/strategies.py, one training step between switches, twice; each switch is timed one of
two ways, alternating switch by switch (swapped in the second pass, so every ordered pair gets
both, close in time on a machine whose load drifts):

- **as-is**: exactly the steps of ``elastic.worker.layout.Layout.build`` (a live switch):
  ``full_state()`` -> ``state_hash`` -> ``close()`` -> ``build_model`` (seeded random init)
  -> ``validate`` -> strategy constructor -> ``load_full_state`` -> ``full_state()`` again
  -> ``state_hash`` of it;
- **patched**: the same steps with four changes that leave the result bit-identical
  (checked: the "after" hash equals the "before" hash): the hash feeds each tensor's buffer to
  sha256 without the ``.numpy().tobytes()`` copy; the new model is built on the meta device
  and materialised uninitialised (``to_empty``), since ``load_full_state`` overwrites every
  entry; DDP is built with ``init_sync=False`` (all ranks load the same state right after,
  so its parameter broadcast is wasted); and the second ``full_state()`` + hash is timed
  separately so the cost of dropping (or deferring) that check can be read off.

Prints per-phase medians (slower rank per switch) and writes JSON with every switch. Nothing in
``elastic/`` or ``strategies/`` is modified: the patches live in this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for p in (BENCH, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

G = 32
MICRO = 4
PHASES = ("full_state", "hash_before", "close", "build_model", "validate", "constructor",
          "load_full_state", "full_state_after", "hash_after")


def layouts() -> list[tuple[str, str]]:
    return [("dp", "gpipe"), ("zero1", "gpipe"), ("zero2", "gpipe"), ("zero3", "gpipe"),
            ("pipeline", "gpipe"), ("pipeline", "1f1b")]


def label(lay: tuple[str, str]) -> str:
    name, sched = lay
    return f"pipeline-{sched}" if name == "pipeline" else name


def euler_cycle(n: int) -> list[int]:
    """A closed walk over the complete digraph on ``n`` nodes using every ordered pair once
    (Hierholzer); starts and ends at node 0."""
    out_edges = {u: [v for v in range(n) if v != u] for u in range(n)}
    stack, walk = [0], []
    while stack:
        u = stack[-1]
        if out_edges[u]:
            stack.append(out_edges[u].pop(0))
        else:
            walk.append(stack.pop())
    return walk[::-1]


def fast_state_hash(state: dict[str, Any]) -> str:
    """The copy-free hash this profile proposed; it landed as ``strategies.state_hash``
    (157e7cc), so both arms now use it."""
    from strategies import state_hash

    return state_hash(state)


def _spec(lay: tuple[str, str], world: int) -> Any:
    from elastic.data import even_shares
    from strategies import StrategySpec

    name, sched = lay
    return StrategySpec(name=name, world_size=world, shares=even_shares(G, world),
                        pp_degree=world if name == "pipeline" else 1, micro_batches=MICRO,
                        schedule=sched)


def _rank_main(rank: int, world: int, port: int, walk: list[int], rounds: int,
               out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    import _strat_common as common

    import strategies.dp as dp_mod
    from elastic.config import loss_function, optimizer_factory
    from elastic.data import StepSampler, fetch_batch, share_bounds
    from elastic.reference import build_model
    from strategies import Runtime, state_hash
    from strategies import get as get_strategy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    rt = Runtime(rank, world, torch.device("cpu"))
    opt_f = optimizer_factory(dict(common.OPTIM))
    loss_f = loss_function(common.LOSS)
    ds = common.dataset_factory()
    sampler = StepSampler(len(ds), G, common.SEED)
    lays = layouts()
    step = 0
    real_ddp = dp_mod.DDP

    def train(strat: Any, spec: Any) -> None:
        nonlocal step
        lo, hi = share_bounds(spec.shares, rank)
        x, y = fetch_batch(ds, sampler.indices(step)[lo:hi])
        strat.train_step(x, y)
        step += 1

    def fresh(spec: Any, state: Any, patched: bool, t: dict[str, float]) -> Any:
        cls = get_strategy(spec.name)
        t0 = time.perf_counter()
        if patched and state is not None:
            torch.manual_seed(common.SEED)
            with torch.device("meta"):
                model = common.model_factory()
            model = model.to_empty(device="cpu")
        else:
            model = build_model(common.model_factory, common.SEED)
        t1 = time.perf_counter()
        cls.validate(spec, model)
        t2 = time.perf_counter()
        if patched:
            dp_mod.DDP = lambda *a, **kw: real_ddp(*a, init_sync=False, **kw)
        try:
            strat = cls(spec, rt, model, opt_f, loss_f)
        finally:
            dp_mod.DDP = real_ddp
        t3 = time.perf_counter()
        if state is not None:
            strat.load_full_state(state)
        t4 = time.perf_counter()
        t.update(build_model=t1 - t0, validate=t2 - t1, constructor=t3 - t2,
                 load_full_state=t4 - t3)
        return strat

    def switch(strat: Any, spec: Any, patched: bool) -> tuple[Any, dict[str, Any]]:
        hasher = fast_state_hash if patched else state_hash
        t: dict[str, Any] = {}
        dist.barrier()
        t0 = time.perf_counter()
        state = strat.full_state()
        t1 = time.perf_counter()
        before = hasher(state)
        t2 = time.perf_counter()
        strat.close()
        t3 = time.perf_counter()
        t["full_state"], t["hash_before"], t["close"] = t1 - t0, t2 - t1, t3 - t2
        new = fresh(spec, state, patched, t)
        t4 = time.perf_counter()
        after_state = new.full_state()
        t5 = time.perf_counter()
        after = hasher(after_state)
        t6 = time.perf_counter()
        t["full_state_after"], t["hash_after"] = t5 - t4, t6 - t5
        t["total"] = t6 - t0
        t["total_without_after_check"] = t4 - t0
        t["preserved"] = before == after
        t["state_mb"] = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
        del state, after_state
        return new, t

    records = []
    cur = walk[0]
    spec = _spec(lays[cur], world)
    strat = fresh(spec, None, False, {})
    train(strat, spec)
    for r in range(rounds):
        for parity in (0, 1):  # the variants alternate switch by switch, swapped in pass 2
            for i, nxt in enumerate(walk[1:]):
                variant = "patched" if (i + parity) % 2 else "as-is"
                spec = _spec(lays[nxt], world)
                t1 = time.perf_counter()
                strat, t = switch(strat, spec, variant == "patched")
                t2 = time.perf_counter()
                train(strat, spec)  # first step in the new layout
                t3 = time.perf_counter()
                train(strat, spec)
                t4 = time.perf_counter()
                t.update(first_step=t3 - t2, second_step=t4 - t3, wall=t2 - t1)
                records.append({"round": r, "variant": variant, "from": label(lays[cur]),
                                "to": label(lays[nxt]), **t})
                cur = nxt
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, rounds: int) -> list[dict[str, Any]]:
    """Per switch, the slower rank's figure of every phase."""
    import torch.multiprocessing as mp

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [ROOT, BENCH, *filter(None, [os.environ.get("PYTHONPATH")])])
    walk = euler_cycle(len(layouts()))
    with tempfile.TemporaryDirectory(prefix="strat-prof-") as out:
        mp.spawn(_rank_main, args=(world, _free_port(), walk, rounds, out), nprocs=world,
                 join=True)
        per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    merged = []
    for recs in zip(*per_rank, strict=True):
        m = dict(recs[0])
        for k, v in m.items():
            if isinstance(v, float):
                m[k] = max(r[k] for r in recs)
        m["preserved"] = all(r["preserved"] for r in recs)
        merged.append(m)
    return merged


def summarize(records: list[dict[str, Any]]) -> str:
    lines = ["| phase | as-is median (s) | patched median (s) |", "|---|---|---|"]
    for ph in (*PHASES, "total", "total_without_after_check", "first_step", "second_step"):
        vals = {}
        for v in ("as-is", "patched"):
            xs = [r[ph] for r in records if r["variant"] == v]
            vals[v] = statistics.median(xs) if xs else float("nan")
        lines.append(f"| {ph} | {vals['as-is']:.3f} | {vals['patched']:.3f} |")
    lines += ["", "| switch | as-is total (s) | patched total (s) | patched without after-check (s) |",
              "|---|---|---|---|"]
    pairs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in records:
        d = pairs.setdefault((r["from"], r["to"]), {"as-is": [], "patched": [], "noafter": []})
        d[r["variant"]].append(r["total"])
        if r["variant"] == "patched":
            d["noafter"].append(r["total_without_after_check"])
    for (a, b), d in pairs.items():
        def med(xs: list[float]) -> str:
            return f"{statistics.median(xs):.3f}" if xs else "-"
        lines.append(f"| {a} -> {b} | {med(d['as-is'])} | {med(d['patched'])} | "
                     f"{med(d['noafter'])} |")
    ok = all(r["preserved"] for r in records)
    lines.append(f"\nstate preserved (hash before == after) in every switch: {ok}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.time()
    recs = run(args.workers, args.rounds)
    print(f"{args.workers} ranks, {len(recs)} switches in {time.time() - t0:.0f}s")
    print(summarize(recs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
