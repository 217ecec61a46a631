"""Ray Data benchmark: what reading a job's samples from a Ray dataset costs against the same
rows in memory, side by side in one run, on one local Ray; and the worker's block read alone.

Part 1, jobs: the same model, rows, global batch, steps and layout, in alternating rounds:

* ``memory``: ``elastic.models.SyntheticRegression`` (map-style, tensors), what each worker
  builds;
* ``ray``: the same rows as a ``ray.data`` pipeline (``from_numpy`` in ``--blocks`` blocks,
  then a ``map_batches`` that renames the columns), run once by the controller; workers read
  their rows from the blocks (``elastic/ray_dataset.py``);
* ``raytrain`` (``--raytrain``): Ray Train's ``TorchTrainer`` with the same pipeline as its
  ``train`` dataset, each worker streaming its split with ``iter_torch_batches`` into DDP
  (the same model, Adam, G / workers rows a batch). It trains on other samples in another
  order (a streamed split, not elastic's fixed per-step samples), so only the times compare.

Per job: seconds from ``fit()`` to the first completed step, the pipeline's own seconds (its
``data`` event), steady samples/s (the median of steps after the first 5), and the largest
parameter difference between the two jobs of a round (the same rows in the same order: it
must be 0 up to float32 sums). Ratios are ray / memory.

Part 2, the read alone (no Ray: tables placed in the block cache): ms per ``get_batch`` of
``--batch`` random rows from ``--read-blocks`` blocks as they are, the same blocks after the
controller's join of small neighbours (``merge_groups``: what a job reads), and one Arrow
``take`` over the blocks joined into one table (the alternative the numpy read replaced).

A benchmark, not a test: it checks nothing. From the repository root:
``python bench/ray_data.py`` (``--help`` for the options).
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import elastic  # noqa: E402 - after the path set-up above
from elastic.models import SyntheticRegression  # noqa: E402


def _model(width: int) -> Any:
    return torch.nn.Sequential(torch.nn.Linear(width, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 4))


def _rename(batch: dict[str, Any]) -> dict[str, Any]:
    return {"features": batch["x"], "target": batch["y"]}


def _ray_ds(x: np.ndarray, y: np.ndarray, blocks: int) -> Any:
    import ray

    return ray.data.from_numpy(x).zip(ray.data.from_numpy(y)).repartition(blocks).map_batches(
        lambda b: {"x": b["data"], "y": b["data_1"]}, batch_format="numpy").map_batches(
        _rename, batch_format="numpy")


def _job(kind: str, args: argparse.Namespace, mem: SyntheticRegression,
         root: str) -> dict[str, Any]:
    from functools import partial

    data: Any = mem if kind == "memory" else _ray_ds(mem.x.numpy(), mem.y.numpy(), args.blocks)
    t0 = time.perf_counter()
    first: list[float] = []
    times: list[float] = []

    def on_step(entry: dict[str, Any]) -> None:
        if not first:
            first.append(time.perf_counter() - t0)
        times.append(entry["samples_per_s"])

    r = elastic.fit(model=partial(_model, args.width), optimizer=lambda p: torch.optim.Adam(p),
                    loss=torch.nn.functional.mse_loss, dataset=data,
                    input_column="features", target_column="target",
                    global_batch_size=args.global_batch, max_steps=args.steps,
                    num_workers=args.workers, strategy=args.strategy, view="none",
                    run_dir=tempfile.mkdtemp(dir=root), on_step=on_step)
    ran = [e.data["seconds"] for e in r.events if e.kind == "data"]
    return {"first_s": first[0], "pipeline_s": ran[0] if ran else 0.0,
            "samples_per_s": statistics.median(times[5:] or times), "state": r.state_dict()}


def _raytrain_loop(cfg: dict[str, Any]) -> None:
    """Ray Train's way with the same pipeline: each worker streams its split of the dataset
    (``iter_torch_batches``, G / workers rows a batch, epoch after epoch) into DDP."""
    import json

    import ray.train
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_model(cfg["width"]))
    opt = torch.optim.Adam(model.parameters())
    shard = ray.train.get_dataset_shard("train")
    ends: list[float] = []
    while len(ends) < cfg["steps"]:
        for batch in shard.iter_torch_batches(batch_size=cfg["per_worker"], drop_last=True):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(batch["features"]), batch["target"])
            loss.backward()
            opt.step()
            ends.append(time.time())
            if len(ends) == cfg["steps"]:
                break
    if ray.train.get_context().get_world_rank() == 0:
        with open(cfg["out"], "w") as f:
            json.dump(ends, f)


def _raytrain(args: argparse.Namespace, mem: SyntheticRegression, root: str) -> dict[str, Any]:
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(tempfile.mkdtemp(dir=root), "steps.json")
    ds = _ray_ds(mem.x.numpy(), mem.y.numpy(), args.blocks)
    t0 = time.time()
    TorchTrainer(_raytrain_loop, train_loop_config={
        "width": args.width, "steps": args.steps, "out": out,
        "per_worker": args.global_batch // args.workers},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=os.path.join(root, "raytrain"), name="data"),
        datasets={"train": ds}).fit()
    with open(out) as f:
        ends = json.load(f)
    rates = [args.global_batch / (b - a) for a, b in zip(ends, ends[1:], strict=False)]
    return {"first_s": ends[0] - t0, "pipeline_s": 0.0,
            "samples_per_s": statistics.median(rates[5:] or rates)}


def _read_bench(args: argparse.Namespace) -> list[float]:
    import pyarrow as pa

    from elastic.ray_connect import _join
    from elastic.ray_dataset import RayBlocks, merge_groups

    per = max(1, args.rows // args.read_blocks)
    d = SyntheticRegression(per * args.read_blocks, in_features=args.width, out_features=4)
    x, y = d.x.numpy(), d.y.numpy()
    tables = [pa.table({"x": pa.FixedSizeListArray.from_arrays(
        pa.array(x[i * per:(i + 1) * per].ravel()), args.width),
        "y": pa.FixedSizeListArray.from_arrays(pa.array(y[i * per:(i + 1) * per].ravel()), 4)})
        for i in range(args.read_blocks)]
    from elastic.data import _column

    b = RayBlocks([None] * len(tables), [per] * len(tables), ("x", "y"), ("float32", "float32"))
    b._tables = dict(enumerate(tables))
    groups = merge_groups([t.nbytes for t in tables], 16 << 20)  # what a controller joins
    j = RayBlocks([None] * len(groups), [per * len(g) for g in groups], ("x", "y"),
                  ("float32", "float32"))
    j._tables = {i: _join(*[tables[k] for k in g])[1] for i, g in enumerate(groups)}
    idx = torch.randperm(len(b))[:args.batch]
    whole = pa.concat_tables(tables)  # the alternative: one Arrow take over every block

    def arrow_take() -> None:
        part = whole.take(pa.array(idx.numpy()))
        _column(part, "x", "float32"), _column(part, "y", "float32")

    out = []
    for read in (lambda: b.get_batch(idx), lambda: j.get_batch(idx), arrow_take):
        read()  # (elastic's: each block's arrays are made on first use)
        t = time.perf_counter()
        for _ in range(20):
            read()
        out.append((time.perf_counter() - t) / 20 * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", type=int, default=50, help="the pipeline's blocks (part 1)")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--strategy", default="dp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--join-bytes", type=int, default=None,
                   help="join neighbouring blocks up to this size (default: the product's, "
                        "elastic.ray_dataset.MERGE_BYTES; 0: no join)")
    p.add_argument("--raytrain", action="store_true",
                   help="also Ray Train's TorchTrainer streaming the same pipeline "
                        "(iter_torch_batches), dp only")
    p.add_argument("--read-blocks", type=int, default=1000, help="blocks (part 2)")
    p.add_argument("--batch", type=int, default=2048, help="rows per read (part 2)")
    args = p.parse_args()
    if args.join_bytes is not None:  # the controller runs in this process
        import elastic.ray_dataset

        elastic.ray_dataset.MERGE_BYTES = args.join_bytes

    import ray

    ray.init(num_cpus=max(os.cpu_count() or 2, args.workers + 1), include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    mem = SyntheticRegression(args.rows, in_features=args.width, out_features=4)
    root = tempfile.mkdtemp(prefix="bench-ray-data-")
    res: dict[str, list[dict[str, Any]]] = {"memory": [], "ray": []}
    kinds = ["memory", "ray"] + (["raytrain"] if args.raytrain else [])
    try:
        for rnd in range(args.rounds):
            order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]  # each goes first
            for kind in order:
                res.setdefault(kind, []).append(_raytrain(args, mem, root) if kind == "raytrain"
                                                else _job(kind, args, mem, root))
            a, b = res["memory"][-1]["state"], res["ray"][-1]["state"]
            diff = max(float((a[k] - b[k]).abs().max()) for k in a)
            print(f"round {rnd}: samples/s memory {res['memory'][-1]['samples_per_s']:.0f}, "
                  f"ray {res['ray'][-1]['samples_per_s']:.0f}; max |memory - ray| parameter "
                  f"difference {diff:.2e}")
    finally:
        ray.shutdown()
    print(f"\n{args.rows} rows x {args.width} floats, G={args.global_batch}, {args.steps} steps, "
          f"{args.workers} workers, {args.strategy}, {args.blocks} blocks, {args.rounds} rounds "
          "(medians)")
    print(f"{'':8} {'first step s':>13} {'pipeline s':>11} {'samples/s':>10}")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("first_s", "pipeline_s",
                                                                "samples_per_s")}
           for k, v in res.items()}
    for k, m in med.items():
        print(f"{k:8} {m['first_s']:13.2f} {m['pipeline_s']:11.2f} {m['samples_per_s']:10.0f}")
    print(f"{'ray/mem':8} {med['ray']['first_s'] / med['memory']['first_s']:13.2f} "
          f"{'':>11} {med['ray']['samples_per_s'] / med['memory']['samples_per_s']:10.2f}")
    if "raytrain" in med:
        print(f"{'ray/raytrain':8} {med['ray']['first_s'] / med['raytrain']['first_s']:9.2f} "
              f"{'':>11} {med['ray']['samples_per_s'] / med['raytrain']['samples_per_s']:10.2f}")
    per_block, joined, whole = _read_bench(args)
    print(f"\nread {args.batch} random rows of {args.read_blocks} blocks: numpy gather per block "
          f"{per_block:.1f} ms, the same after the small blocks are joined (what a job reads) "
          f"{joined:.1f} ms, one Arrow take over all blocks {whole:.1f} ms")


if __name__ == "__main__":
    main()
