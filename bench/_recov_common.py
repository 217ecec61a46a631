"""Shared workload of bench/recovery.py: the same model, data, loss, optimizer and data order
for elastic and for Ray Train's TorchTrainer.

A 4-layer tanh MLP (64 -> 512 -> 512 -> 512 -> 8, 0.56M parameters), Adam, MSE plus a fixed
50 ms wait per step in the loss (so a step lasts long enough to be hit mid-run and 3 workers
plus 4 raylets do not saturate the 2 cores), global batch 48 split evenly over the workers,
the samples of step s fixed by ``elastic.data.StepSampler`` (seed 0). Ray Train's loop below
is plain DDP with these pieces; it writes one JSON line per event (start, step, checkpoint,
error) to a per-process progress file, which is how the driver follows it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import torch
from torch import nn

from elastic.models import SyntheticRegression, tiny_mlp
from strategies.dp import no_forward_buffer_sync

SEED = 0
G = 48
STEP_WAIT_S = 0.05
MODEL = {"in_features": 64, "hidden": 512, "out_features": 8, "depth": 4}
DATA = {"n": 4096, "in_features": 64, "out_features": 8, "seed": SEED}
OPTIM = {"name": "adam", "lr": 1e-3}

model_factory = functools.partial(tiny_mlp, **MODEL)
dataset_factory = functools.partial(SyntheticRegression, **DATA)


def slow_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    time.sleep(STEP_WAIT_S)
    return nn.functional.mse_loss(out, y)


def _slow(loss: Any, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    time.sleep(STEP_WAIT_S)
    return loss(out, y)


def workload(family: str) -> tuple[Any, Any, Any, int]:
    """(model factory, dataset factory, loss, global batch) of ``family``: ``recov`` is the
    workload above; any family of ``bench/_planner_models.py`` (mlp, convnet, gpt, mixer,
    dlrm) holds the benchmark against a model it was not written for, with the same 50 ms
    wait per step in its loss (elastic only: Ray Train's loop is written for ``recov``)."""
    if family == "recov":
        return model_factory, dataset_factory, slow_mse, G
    from _planner_models import ALL as FAMILIES

    f = FAMILIES[family]
    return f.model, f.dataset, functools.partial(_slow, f.loss), f.global_batch


def _log(prog_dir: str, rec: dict[str, Any]) -> None:
    rec = {"pid": os.getpid(), "time": time.time(), **rec}
    with open(os.path.join(prog_dir, f"prog-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def raytrain_loop(cfg: dict[str, Any]) -> None:
    """Ray Train worker: DDP over the shared workload; a checkpoint (model, optimizer, next
    step) from rank 0 every ``every`` steps via ``ray.train.report``; resume from
    ``ray.train.get_checkpoint()``."""
    import tempfile

    import ray
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic.data import StepSampler, even_shares, share_bounds

    torch.set_num_threads(1)
    prog, steps, every = cfg["prog_dir"], int(cfg["steps"]), int(cfg["every"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = model_factory()
    opt = torch.optim.Adam(model.parameters(), lr=OPTIM["lr"])
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            st = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        start = int(st["next_step"])
    ddp = DDP(model, **no_forward_buffer_sync())
    ds = dataset_factory()
    sampler = StepSampler(len(ds), G, SEED)
    lo, hi = share_bounds(even_shares(G, world), rank)
    _log(prog, {"event": "start", "rank": rank, "world": world, "resume_step": start,
                "node_id": ray.get_runtime_context().get_node_id()})
    try:
        for step in range(start, steps):
            x, y = ds.get_batch(sampler.indices(step)[lo:hi])
            opt.zero_grad(set_to_none=True)
            loss = slow_mse(ddp(x), y) * ((hi - lo) * world / G)
            loss.backward()
            opt.step()
            _log(prog, {"event": "step", "rank": rank, "step": step, "world": world})
            if (step + 1) % every == 0 or step + 1 == steps:
                t0 = time.time()
                with tempfile.TemporaryDirectory() as d:
                    c = None
                    if rank == 0:
                        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                                    "next_step": step + 1}, os.path.join(d, "state.pt"))
                        c = ray.train.Checkpoint.from_directory(d)
                    ray.train.report({"step": step, "loss": float(loss)}, checkpoint=c)
                _log(prog, {"event": "checkpoint", "rank": rank, "step": step + 1,
                            "seconds": time.time() - t0})
    except BaseException as e:
        _log(prog, {"event": "error", "rank": rank, "msg": f"{type(e).__name__}: {e}"[:300]})
        raise


def raytrain_preempt_loop(cfg: dict[str, Any]) -> None:
    """``raytrain_loop`` with Ray Train V2's preemption handling as its docs advise, at its
    best: every step asks ``ray.train.get_preemption_info()`` (a barrier over the workers);
    once a node is announced, training goes on and one just-in-time checkpoint is reported
    as late as is still safe (when the time left is under twice a checkpoint plus a step),
    so that the restart Ray Train makes at the deadline runs as few steps again as it can."""
    import tempfile

    import ray
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic.data import StepSampler, even_shares, share_bounds

    torch.set_num_threads(1)
    prog, steps, every = cfg["prog_dir"], int(cfg["steps"]), int(cfg["every"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = model_factory()
    opt = torch.optim.Adam(model.parameters(), lr=OPTIM["lr"])
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            st = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        start = int(st["next_step"])
    ddp = DDP(model, **no_forward_buffer_sync())
    ds = dataset_factory()
    sampler = StepSampler(len(ds), G, SEED)
    lo, hi = share_bounds(even_shares(G, world), rank)
    _log(prog, {"event": "start", "rank": rank, "world": world, "resume_step": start,
                "node_id": ray.get_runtime_context().get_node_id()})

    def report(step: int, loss: float, why: str) -> float:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as d:
            c = None
            if rank == 0:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                            "next_step": step + 1}, os.path.join(d, "state.pt"))
                c = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": step, "loss": loss}, checkpoint=c)
        dt = time.time() - t0
        _log(prog, {"event": "checkpoint", "rank": rank, "step": step + 1, "seconds": dt,
                    "why": why})
        return dt

    ck_s, step_s, jit_done, seen = 0.5, 0.1, False, False
    try:
        for step in range(start, steps):
            t0 = time.time()
            x, y = ds.get_batch(sampler.indices(step)[lo:hi])
            opt.zero_grad(set_to_none=True)
            loss = slow_mse(ddp(x), y) * ((hi - lo) * world / G)
            loss.backward()
            opt.step()
            _log(prog, {"event": "step", "rank": rank, "step": step, "world": world})
            if (step + 1) % every == 0 or step + 1 == steps:
                ck_s = report(step, float(loss), "periodic")
            info = ray.train.get_preemption_info()
            step_s = time.time() - t0
            if info is not None and not seen:
                seen = True
                _log(prog, {"event": "notice", "rank": rank, "step": step,
                            "deadline_ms": info.deadline_ms, "ranks": info.preempted_ranks})
            if info is not None and not jit_done and info.deadline_ms is not None:
                left = info.deadline_ms / 1e3 - time.time()
                due = torch.tensor([1.0 if left < 2 * (ck_s + step_s) else 0.0])
                dist.all_reduce(due, op=dist.ReduceOp.MAX)  # every rank reports, or none
                if due.item():
                    report(step, float(loss), "just in time")
                    jit_done = True
    except BaseException as e:
        _log(prog, {"event": "error", "rank": rank, "msg": f"{type(e).__name__}: {e}"[:300]})
        raise
