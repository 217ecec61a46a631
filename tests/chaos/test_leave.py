"""A rank that leaves its group releases the group's connections at once.

After a node loss the survivors' collectives fail, but not all at once: a survivor waiting on
another survivor (not on the dead rank) fails only when that one closes its connections. A
gloo group closes them only when its last reference goes, and torch pins groups in several
places (default arguments evaluated at import, DeviceMesh registries, exception frames). If
any of them survives ``Worker.leave()``, the blocked survivor waits out the whole group
timeout and the hang watchdog then takes it for hung. Four real processes, gloo, a real
SIGKILL; no Ray (the worker runs as in ``bench/gpu_check.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.mp_harness import free_port

GROUP_TIMEOUT_S = 30.0


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _rank(rank: int, world: int, port: int, layout: str, results, done) -> None:
    from elastic.config import JobConfig
    from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp
    from elastic.worker import Worker
    from strategies import StrategySpec

    torch.set_num_threads(1)
    cfg = JobConfig(model=tiny_mlp, optimizer=_adam, loss=mlp_loss, dataset=SyntheticRegression,
                    global_batch_size=8 * world, max_steps=10**6, num_workers=world)
    w = Worker(cfg, rank, False, 1)
    w.join("127.0.0.1", port, rank, world, 1, GROUP_TIMEOUT_S)
    name, _, dp_mode = layout.partition("-")
    kw = {"pp_degree": 2, "micro_batches": 2, "dp_mode": dp_mode or "dp"} if name == "pipeline" else {}
    w.build(StrategySpec(name, world, shares=(8,) * world, **kw))
    if rank == 1:  # dies mid-run, as on a lost node
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        w.run(0, 10**6)
    except Exception:  # noqa: BLE001 - the group failure is what this test waits for
        pass
    failed = time.time()
    w.leave()
    left = time.time()
    results.put((rank, failed, left))
    done.wait(GROUP_TIMEOUT_S + 10)  # stay up, as a survivor does, while the others find out


@pytest.mark.parametrize("layout", ["dp", "zero3", "pipeline-zero3"])
def test_survivors_fail_fast_after_a_peer_leaves(layout):
    world = 4
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, layout, results, done), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world - 1:
            rank, failed, left = results.get(timeout=120)
            got[rank] = (failed, left)
    finally:
        done.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    first = min(f for f, _ in got.values())
    late = {r: round(f - first, 2) for r, (f, _) in got.items()}
    # without the fixes one survivor fails only at the group timeout (30 s)
    assert max(late.values()) < 5.0, late
    assert sorted(got) == [0, 2, 3]


class _FailingWorldAllReduce:
    """``torch.distributed`` as the pipeline strategy sees it, except that the step's final
    world-wide all-reduce fails as a lost peer makes it fail (torch's typed network error;
    the worker types errors by class and origin, never by their text)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_reduce(self, tensor, *args, **kwargs):
        raise self._real.DistNetworkError("[gloo/transport/tcp/pair.cc] Connection closed by peer")


def _pending_rank(port: int, steps: int, clip: float | None = None) -> dict:
    import torch.distributed as dist

    import strategies.pipeline as pipeline_mod
    from elastic.config import JobConfig
    from elastic.errors import InfrastructureError
    from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp
    from elastic.worker import Worker
    from strategies import StrategySpec

    rank, world = dist.get_rank(), dist.get_world_size()  # the harness's group; join replaces it
    cfg = JobConfig(model=tiny_mlp, optimizer=_adam, loss=mlp_loss, dataset=SyntheticRegression,
                    global_batch_size=8 * world, max_steps=100, num_workers=world,
                    max_grad_norm=clip)
    w = Worker(cfg, rank, False, 1)
    w.join("127.0.0.1", port, rank, world, 1, GROUP_TIMEOUT_S)
    w.build(StrategySpec("pipeline", world, shares=(8,) * world, pp_degree=world,
                         micro_batches=2))
    w.run(0, steps)
    # step `steps` computes its gradients completely, then its final all-reduce fails here
    pipeline_mod.dist = _FailingWorldAllReduce(pipeline_mod.dist)
    try:
        w.run(steps, steps + 1)
        raise AssertionError("the step should have failed")
    except InfrastructureError:
        pass
    finally:
        pipeline_mod.dist = pipeline_mod.dist._real
    w.leave()  # as the controller makes a finished rank leave at once (strategy dropped)
    before = w.progress()
    parked = {k: v.clone() for k, v in w.held.snapshot.items() if k.startswith("model/")}
    after = w.finish_pending_step()  # a peer applied the step: roll forward, no group needed
    rolled = {k: v.clone() for k, v in w.held.snapshot.items() if k.startswith("model/")}
    return {"before": before, "after": after, "parked": parked, "rolled": rolled}


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_step_whose_final_all_reduce_failed_rolls_forward_after_leave(clip):
    """A pipeline rank whose gradients were complete when the step's final all-reduce failed
    keeps, after ``leave`` dropped its strategy, both its state at the step and the state with
    the update applied; ``finish_pending_step`` takes the latter. Checked against the
    single-process reference at both steps. With ``max_grad_norm`` (0.5: the reference's
    norms are 0.44-0.71, so the rolled step clips) the norm's all-reduce ran before the
    failed one: the rolled update is the clipped one."""
    from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp
    from elastic.reference import reference_train
    from tests.mp_harness import run_distributed

    world, steps = 2, 3
    out = run_distributed(_pending_rank, world, free_port(), steps, clip)
    data = SyntheticRegression()
    at_s, _ = reference_train(tiny_mlp, _adam, mlp_loss, data, 8 * world, steps, seed=0,
                              max_grad_norm=clip)
    at_s1, _ = reference_train(tiny_mlp, _adam, mlp_loss, data, 8 * world, steps + 1, seed=0,
                               max_grad_norm=clip)
    parked = {k: v for o in out for k, v in o["parked"].items()}
    rolled = {k: v for o in out for k, v in o["rolled"].items()}
    assert sorted(parked) == sorted(f"model/{k}" for k in at_s)  # the stages cover the model
    for o in out:
        assert o["before"]["pending_update"] and o["before"]["next_step"] == steps
        assert o["after"] == steps + 1
    assert max((parked[f"model/{k}"] - v).abs().max().item() for k, v in at_s.items()) < 1e-6
    assert max((rolled[f"model/{k}"] - v).abs().max().item() for k, v in at_s1.items()) < 1e-6
