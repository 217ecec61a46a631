"""Shared workload of bench/overhead.py: one model, one dataset, one optimizer, one data order.

All three systems (elastic, torchrun DDP, Ray Train) build exactly this, seeded the same way, and
fetch each step's samples with the same ``StepSampler`` and ``get_batch`` path, so the only
difference between them is how the loop is launched and orchestrated. Imported as a top-level
module (``bench/`` is put on PYTHONPATH by overhead.py).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import torch

from elastic.data import StepSampler, even_shares, share_bounds
from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp
from strategies.dp import no_forward_buffer_sync

SEED = 0
MODEL = {"in_features": 256, "hidden": 1024, "out_features": 16, "depth": 4}  # ~2.38M params
DATA = {"n": 8192, "in_features": 256, "out_features": 16, "seed": 0}
OPTIM = {"name": "sgd", "lr": 0.01, "momentum": 0.9}

model_factory = functools.partial(tiny_mlp, **MODEL)
dataset_factory = functools.partial(SyntheticRegression, **DATA)
loss_fn = mlp_loss


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    kw = {k: v for k, v in OPTIM.items() if k != "name"}
    return torch.optim.SGD(params, **kw)


def ddp_loop(rank: int, world: int, global_batch: int, steps: int, report_every: int = 0,
             report: Any = None) -> dict[str, Any]:
    """A plain DDP training loop (the baseline). Returns rank-local per-step wall times
    (``time.time()`` at the end of each step) and losses. The process group must exist.
    ``report(step, loss)`` is called after every ``report_every``-th step (Ray Train)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert dist.is_initialized()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = model_factory()
    ddp = DDP(model, **no_forward_buffer_sync())
    opt = make_optimizer(ddp.parameters())
    ds = dataset_factory()
    sampler = StepSampler(len(ds), global_batch, SEED)
    lo, hi = share_bounds(even_shares(global_batch, world), rank)
    times: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        x, y = ds.get_batch(sampler.indices(step)[lo:hi])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        times.append(time.time())
        if report_every and (step + 1) % report_every == 0 and step + 1 < steps:
            report(step, losses[-1])
    return {"times": times, "losses": losses, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters())}


def write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
