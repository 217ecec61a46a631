"""Host-memory state between ranks, without Ray: an evacuation's hand-off and the buddies'
copies (``elastic/worker/handoff.py``, ``elastic/worker/peer_copies.py``).

The pure parts are in ``tests/unit/test_peer_copies_parts.py``. Here the collective parts run
on a pool of 4 spawned gloo processes (``tests/mp_harness.py``) whose Python state survives from one run to the next: a first run
on 3 or 4 ranks trains a layout and hands off (or copies) pieces, a second run on one process
fewer, a new group as after the last is gone, loads a new layout from what the survivors
hold, and the state is the one the old group had.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic.control.regroup import buddy_step
from elastic.errors import StateMoveError
from elastic.worker.peer_copies import PeerCopies
from strategies import StrategySpec, state_hash
from tests.mp_harness import ProcessPool

SEED = 3
G = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(G, 4, generator=g), torch.randn(G, 2, generator=g)


def _layout(name: str, world: int, load: bool, **kw: Any) -> Any:
    from elastic.reference import build_model_for_load
    from strategies import Runtime, registry

    spec = StrategySpec(name=name, world_size=world, shares=_shares(world), **kw)
    model = build_model_for_load(_model, SEED) if load else _model()
    return registry.get(name)(spec, Runtime.current("cpu"), model,
                              lambda p: torch.optim.Adam(p, lr=1e-2), F.mse_loss)


def _shares(world: int) -> tuple[int, ...]:
    base, extra = divmod(G, world)
    return tuple(base + (1 if r < extra else 0) for r in range(world))


def _train(strat: Any, start: int, end: int) -> None:
    from elastic.data import share_bounds

    lo, hi = share_bounds(strat.spec.shares, dist.get_rank())
    for s in range(start, end):
        x, y = _data(s)
        strat.train_step(x[lo:hi], y[lo:hi])


_KEPT: dict[str, Any] = {}  # survives between runs of the same pool process


class _Members:
    """What ``PeerCopies`` reads of ``Membership``, over the pool's group."""

    def __init__(self, generation: int) -> None:
        from elastic.worker.membership import control_group

        self.rank, self.world, self.generation = dist.get_rank(), dist.get_world_size(), generation
        self.copies_group = control_group(self.rank, self.world, generation, 30.0,
                                          "elastic-copies")


def _hand_off_then_leave(source: tuple[str, dict[str, Any]], steps: int,
                         leaving: list[int]) -> dict[str, Any]:
    """``source`` on every rank: train; the ``leaving`` ranks hand their pieces off; everyone
    parks what it holds."""
    from elastic.worker.handoff import hand_off
    from elastic.worker.held_state import HeldState

    strat = _layout(source[0], dist.get_world_size(), load=False, **source[1])
    _train(strat, 0, steps)
    full = state_hash(strat.full_state())
    held = HeldState()
    got, out = hand_off(held.pieces(strat), leaving, torch.device("cpu"))
    held.carried += got
    held.park(strat)
    strat.close()
    _KEPT["held"] = held
    return {"hash": full, **out}


def _load_from_held(target: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """The survivors, a new group: load ``target`` from the parked and carried pieces."""
    from strategies import move_pieces

    strat = _layout(target[0], dist.get_world_size(), load=True, **target[1])
    res = move_pieces(_KEPT.pop("held").pieces(None), strat)
    out = {"hash": state_hash(strat.full_state()), "problems": res.problems}
    strat.close()
    return out


def _copy_then_lose(every: int, steps: int, corrupt: bool | str) -> dict[str, Any]:
    """3 ranks: zero3 with copies every ``every`` steps, settled through a sum as the step
    loop does; train ``steps``; return the hash of the state at the last copy."""
    strat = _layout("zero3", 3, load=False)
    node = f"node{dist.get_rank()}"
    # a generation of its own each run: two runs in a row over one world reuse the pool's
    # store, where a copies group of the same generation would find the last run's addresses
    _KEPT["generation"] = _KEPT.get("generation", 0) + 1
    copies = PeerCopies(every, None, _Members(_KEPT["generation"]),  # type: ignore[arg-type]
                        lambda: node)
    hashes = {}
    for s in range(steps):
        _train(strat, s, s + 1)
        if copies.due(s + 1):
            hashes[s + 1] = state_hash(strat.full_state())
            copies.begin(strat, s + 1)
            _pending = copies._pending
            assert _pending is not None
            _pending.done.wait(30)  # a test: settle at once rather than steps later
        flag = torch.tensor([copies.flag()], dtype=torch.float64)
        dist.all_reduce(flag)
        copies.settle(float(flag), 3)
    if corrupt == "own" and dist.get_rank() == 0:  # its own snapshot, not a ward's copy
        gen = copies._committed
        assert gen is not None
        gen.own[0][3].view(-1)[0] += 1.0
    elif corrupt and dist.get_rank() == 0:
        assert copies.corrupt()
    strat.close()
    _KEPT["copies"] = copies
    return {"hashes": hashes, "status": copies.status()}


def _load_from_copies(step: int, joined: tuple[int, ...] = ()) -> dict[str, Any]:
    """The survivors (and the ranks ``joined``: replacements that hold no copy) load the
    state at ``step`` into zero2 over the new group."""
    from strategies import move_pieces

    copies = _KEPT.pop("copies")
    if dist.get_rank() in joined:  # a new process: no copies (and no collective to make one)
        new = SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size(), generation=2,
                              copies_group=None)
        copies = PeerCopies(2, None, new, lambda: "new-node")  # type: ignore[arg-type]
    try:
        pieces, err = copies.restore_pieces(step), ""
    except StateMoveError as e:
        pieces, err = [], str(e)
    ok = torch.tensor([0.0 if err else 1.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return {"error": err or "another rank's copy does not match its checksum"}
    strat = _layout("zero2", dist.get_world_size(), load=True)
    res = move_pieces(pieces, strat)
    out = {"hash": state_hash(strat.full_state()), "problems": res.problems}
    strat.close()
    return out


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(4)
    yield p
    p.close()


def _pp(pp_degree: int, dp_mode: str = "dp") -> dict[str, Any]:
    return dict(pp_degree=pp_degree, micro_batches=3, schedule="1f1b", dp_mode=dp_mode)


# id: (source layout, world, the survivors' layout): every layout's draining rank (the last:
# the pool's survivors are its first processes) is emptied into the survivors, whatever
# layout they go on in.
EVACUATIONS = {
    "dp": (("dp", {}), 3, ("zero3", {})),
    "zero1": (("zero1", {}), 3, ("dp", {})),
    "zero2": (("zero2", {}), 3, ("zero1", {})),
    "zero3": (("zero3", {}), 3, ("zero2", {})),
    "pipeline": (("pipeline", _pp(3)), 3, ("pipeline", _pp(2))),
    "pp2xzero2": (("pipeline", _pp(2, "zero2")), 4, ("zero3", {})),
    "pp2xzero3": (("pipeline", _pp(2, "zero3")), 4, ("pipeline", _pp(3))),
}


@pytest.mark.parametrize("case", list(EVACUATIONS))
def test_a_draining_ranks_pieces_are_handed_off_and_the_survivors_load_any_layout(pool, case):
    """Under every layout: what only the leaving rank holds reaches a survivor (nothing when
    replicas hold it all), and the survivors' new layout holds the state exactly (hash)."""
    source, world, target = EVACUATIONS[case]
    leaving = world - 1
    first = pool.run(_hand_off_then_leave, source, 3, [leaving], world_size=world)
    assert len({r["hash"] for r in first}) == 1
    sent = [r["bytes_sent"] for r in first]
    assert sum(r["bytes_received"] for r in first) == sent[leaving]
    assert all(b == 0 for r, b in enumerate(sent) if r != leaving)
    if case == "dp":  # every survivor holds a replica of it all
        assert sent[leaving] == 0
    else:
        assert sent[leaving] > 0
    second = pool.run(_load_from_held, target, world_size=world - 1)
    for r in second:
        assert r["problems"] == [] and r["hash"] == first[0]["hash"], r


def test_a_lost_ranks_shard_comes_back_from_its_buddys_copy(pool):
    first = pool.run(_copy_then_lose, 2, 5, False, world_size=3)
    hashes = first[0]["hashes"]
    assert sorted(hashes) == [2, 4]
    # rank 1 keeps rank 0's copy, rank 2 keeps rank 1's, rank 0 keeps rank 2's
    assert sorted(first[0]["status"]["steps"]) == [4]
    # which losses the survivors' memory covers (what the controller asks before a restore)
    st = [r["status"] for r in first]
    need = {k for s in st for k, _, _ in s["steps"][4]}
    assert buddy_step([st[0], st[1]], need) == 4  # rank 2 lost: rank 0 holds its copy
    assert buddy_step([st[0], st[2]], need) == 4  # rank 1 lost: rank 2 holds its copy
    assert buddy_step([st[0]], need) is None  # 1 and 2, buddies of each other: storage
    second = pool.run(_load_from_copies, 4, world_size=2)  # rank 2 is gone
    for r in second:
        assert r.get("problems") == [] and r["hash"] == hashes[4], r


def test_a_replacement_that_holds_no_copy_joins_the_restore_from_the_buddies(pool):
    """After a loss the job takes a replacement in (min_workers defaults to num_workers),
    and the new group restores from the survivors' copies: the newcomer holds none and
    brings nothing. Was: it refused ("no copy of step 4 is held here"), so every rank
    refused and the job went back to its checkpoint, or to step 0."""
    first = pool.run(_copy_then_lose, 2, 5, False, world_size=3)
    second = pool.run(_load_from_copies, 4, (2,), world_size=3)  # rank 2 is a new process
    for r in second:
        assert r.get("problems") == [] and r["hash"] == first[0]["hashes"][4], r


def test_a_rank_whose_own_snapshot_changed_refuses_it(pool):
    """A rank's own snapshot is checked against its checksum at restore, as the copies it
    keeps for others are. Was: loaded unchecked (about half of what a restore uses)."""
    pool.run(_copy_then_lose, 2, 3, "own", world_size=3)
    second = pool.run(_load_from_copies, 2, world_size=2)
    errors = [r.get("error", "") for r in second]
    assert "rank 0's own snapshot of step 2 does not match its checksum" in errors[0], errors
    assert "another rank's copy" in errors[1]


def test_a_corrupt_copy_is_refused_on_every_rank(pool):
    pool.run(_copy_then_lose, 2, 3, True, world_size=3)
    second = pool.run(_load_from_copies, 2, world_size=2)
    errors = [r.get("error", "") for r in second]
    assert errors[0].startswith("the copy of rank 2's state (step 2) held by rank 0 does not "
                                "match its checksum"), errors
    assert "another rank's copy" in errors[1]
