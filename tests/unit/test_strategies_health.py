"""Collective failures recorded as state (``strategies.health``): DDP's reducer re-raises a
gloo failure from the autograd engine, where its frames do not tell it from a user's error,
so the dp layout's comm hook records it. Two spawned gloo processes; the peer leaves after
two good steps (DDP's second forward still broadcasts its rebuilt bucket order: from then on
a step's only collective is the gradient all-reduce)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from tests.mp_harness import free_port


def _rank(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from strategies import Runtime, StrategySpec, get, health

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    spec = StrategySpec("dp", 2, (4, 4))
    strat = get("dp")(spec, Runtime.current(), nn.Linear(4, 2),
                      lambda p: torch.optim.SGD(p, lr=0.1), F.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for _ in range(2):  # good steps record nothing
        strat.train_step(x, y)
    clean = health.failed()
    dist.barrier()
    if rank == 1:
        os._exit(0)  # the peer is gone: no close, no goodbye
    try:
        strat.train_step(x, y)
        results.put((clean, None, "the step did not fail"))
    except Exception:  # what the worker's boundary would see
        import traceback

        results.put((clean, health.failed(), traceback.format_exc()))
    os._exit(0)


def test_a_ddp_step_whose_peer_died_records_the_failure() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        clean, recorded, error = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert clean is None
    assert recorded is not None, error
    assert recorded.startswith("DDP gradient all-reduce of bucket 0"), recorded
