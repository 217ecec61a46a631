"""Buddy copies right after a restore, without Ray: the worker actor's own restore calls
(``elastic.worker.actor.Worker``, built outside Ray) on a pool of 3 spawned processes that
form their groups with ``Worker.join`` as the controller has them do
(``tests/mp_harness.py`` spawns the processes; each run forms a new group, as after a loss).

A zero3 job without checkpoints recovers from its buddies' copies. Every restore drops the
old ring's copies; the first copy of the new group used to begin only after the first step's
compute and to be reported when its exchange ended, so a second loss right after a recovery
(a wave of spot reclaims) found no copy (``copies_status`` empty, ``buddy_step`` None) and
went back to the checkpoint, or to step 0. Now every restore takes the restored state's copies
before it returns: ``copies_status`` holds the restored step with no step trained since.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from elastic.config import JobConfig
from elastic.control.regroup import buddy_step, required_keys
from strategies import StrategySpec
from tests.helpers import RegressionData, adam, mlp, mse
from tests.mp_harness import ProcessPool, free_port

G = 6  # even shares on 3, 2 and 1 ranks
EVERY = 5

_KEPT: dict[str, Any] = {}  # survives between runs of the same pool process


def _cfg(run_dir: str) -> JobConfig:
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=G, max_steps=100, num_workers=3, run_dir=run_dir,
                    peer_copies_every=EVERY)
    cfg.validate()
    return cfg


def _spec(name: str, world: int) -> StrategySpec:
    return StrategySpec(name, world, tuple([G // world] * world))


def _rank() -> int:
    """This process's index in the pool (its rank in the pool's group, kept from the first
    run, which spans every process), with the pool's group let go: ``Worker.join`` forms
    the rank's own, as the actor's does."""
    if dist.is_initialized():
        _KEPT.setdefault("index", dist.get_rank())
        dist.destroy_process_group()
    return int(_KEPT["index"])


def _required(statuses: list[dict[str, Any]]) -> set[str]:
    """The keys the controller requires of the copies (``Regroup.restore``)."""
    model = mlp()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return required_keys(list(model.state_dict()), trainable,
                         [{k: None for k, _, _ in pieces} for st in statuses
                          for pieces in st["steps"].values()])


def _start(run_dir: str, port: int, world: int, layout: str, steps: int,
           hash_at: int) -> dict[str, Any]:
    """Every rank: a worker of its own, group generation 1, ``layout`` trained ``steps``
    steps (the state's hash taken at ``hash_at``); then it leaves, parking its state, as
    survivors do when a peer is lost."""
    from elastic.worker.actor import Worker

    rank = _rank()
    w = Worker(_cfg(run_dir), rank, False, 1)
    _KEPT["worker"] = w
    w.join("127.0.0.1", port, rank, world, 1, 30.0)
    w.build(_spec(layout, world))
    w.run(0, hash_at)
    h = w.state_hash()
    w.run(hash_at, steps)
    deadline = time.monotonic() + 30.0  # the last copy's exchange ends on its own thread
    while (steps >= EVERY and EVERY not in w.copies_status()["steps"]
           and time.monotonic() < deadline):
        time.sleep(0.01)
    status = w.copies_status()
    w.leave()
    return {"hash": h, "status": status, "keys": w.held_keys()}


def _restore(port: int, world: int, generation: int, how: str, step: int,
             plan: list[Any] | None = None) -> dict[str, Any]:
    """The survivors (the pool's first ``world`` processes) form generation ``generation``
    and restore the state at ``step`` into zero3 (``how``: from the buddies' copies or from
    peers): what ``copies_status`` says before and right after, no step trained between."""
    w = _KEPT["worker"]
    rank = _rank()
    w.join("127.0.0.1", port, rank, world, generation, 30.0)
    before = w.copies_status()
    if how == "copies":
        out = w.restore_from_copies(_spec("zero3", world), step)
    else:
        out = w.restore_from_peers(_spec("zero3", world), plan, step)
    after = w.copies_status()  # (what the controller reads when the next loss comes)
    progress = w.progress()
    h = w.state_hash()
    w.leave()
    return {"before": before, "after": after, "out": out, "hash": h,
            "next_step": progress["next_step"]}


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(3)
    yield p
    p.close()


def test_a_second_loss_right_after_a_recovery_from_the_buddies_finds_the_restored_step(
        pool, tmp_path):
    """zero3 on 3 ranks, copies every 5 steps, 7 steps trained: rank 2 is lost, the two
    survivors restore step 5 from the buddies' copies. Right after (no step trained), each
    survivor's ``copies_status`` holds step 5, and together they cover the state; then rank 1
    is lost too and rank 0 alone restores step 5 again from the copies the restore took: the
    state is the one the first group had at step 5. Without the restore's own copy the
    status was empty there (the first copy came after the first step), ``buddy_step`` None:
    the second loss went to the checkpoint, or to step 0."""
    first = pool.run(_start, str(tmp_path / "run"), free_port(), 3, "zero3", 7, EVERY,
                     world_size=3)
    assert all(EVERY in r["status"]["steps"] for r in first), [r["status"] for r in first]
    h5 = first[0]["hash"]

    second = pool.run(_restore, free_port(), 2, 2, "copies", EVERY, world_size=2)
    assert buddy_step([r["before"] for r in second], _required(
        [r["before"] for r in second])) == EVERY  # (what the first recovery went back to)
    assert all(r["hash"] == h5 and r["next_step"] == EVERY for r in second)
    after = [r["after"] for r in second]
    assert all(list(a["steps"]) == [EVERY] and a["bytes"] > 0 for a in after), after
    assert buddy_step(after, _required(after)) == EVERY, after
    assert all(r["out"]["copies_bytes"] > 0 and r["out"]["copies_s"] >= 0 for r in second)

    third = pool.run(_restore, free_port(), 1, 3, "copies", EVERY, world_size=1)
    assert third[0]["hash"] == h5 and third[0]["next_step"] == EVERY
    assert list(third[0]["after"]["steps"]) == []  # one rank: no buddy, copies off


def test_a_restore_from_peers_is_covered_by_copies_at_once(pool, tmp_path):
    """dp on 3 ranks, 3 steps (no copy yet: the first is due after step 4; dp's replicas
    are on one node here, so copies would be on): rank 2 is lost, the survivors restore
    step 3 from their peers' replicas into zero3, where no replica is left. Right after,
    ``copies_status`` holds step 3 on both and covers the state: a second loss comes back
    to step 3 from the buddies. Was: nothing until the first step's copy had settled."""
    first = pool.run(_start, str(tmp_path / "run"), free_port(), 3, "dp", 3, 3,
                     world_size=3)
    assert all(r["status"]["steps"] == {} for r in first)
    keys = first[0]["keys"]
    plan = [(k, 0, shape, dtype) for k, (shape, dtype) in sorted(keys.items())]
    second = pool.run(_restore, free_port(), 2, 2, "peers", 3, plan, world_size=2)
    assert all(r["hash"] == first[0]["hash"] and r["next_step"] == 3 for r in second)
    after = [r["after"] for r in second]
    assert all(list(a["steps"]) == [3] for a in after), after
    assert buddy_step(after, _required(after)) == 3, after
