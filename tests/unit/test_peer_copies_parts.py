"""The pure parts of moving host-memory state between ranks (``elastic/worker/handoff.py``,
``elastic/worker/peer_copies.py``): hand-off plans, buddy rings, which pieces need a copy,
copy buffers and their checksums, the copies' settling rules. No process group; the
collective parts are in ``tests/integration/test_peer_copies.py``."""

from __future__ import annotations

import torch

from elastic.worker.handoff import covered, handoff_plan
from elastic.worker.peer_copies import (
    FAILED,
    PeerCopies,
    _stamp,
    _stamped,
    _views,
    buddies,
    layout_offsets,
    unique_pieces,
)

W = ((6, 2), "float32")


def _m(key: str, rows: tuple[int, int] | None, shape: tuple[int, ...] = (6, 2)):
    return (key, shape, "float32", rows)


def test_covered():
    assert covered((0, 6), [(0, 3), (3, 6)]) and covered((2, 4), [(0, 6)])
    assert not covered((0, 6), [(0, 3), (4, 6)]) and not covered((0, 1), [])


def test_handoff_plan_moves_only_what_no_survivor_holds():
    # zero3-like rows: rank 2 leaves, its rows go to the least loaded survivor
    rows = [[_m("w", (2 * r, 2 * r + 2)), _m("b", (r, r + 1), (3,))] for r in range(3)]
    plan = handoff_plan(rows, [2])
    assert plan == [(2, 0, 0), (2, 1, 1)]
    # dp-like replicas: nothing moves
    assert handoff_plan([[_m("w", None)]] * 3, [1]) == []
    # two leave: each piece once, to survivors only
    plan = handoff_plan(rows, [1, 2])
    assert {d for _, _, d in plan} == {0} and len(plan) == 4
    assert handoff_plan(rows, [0, 1, 2]) == []  # nobody to hand to


def test_buddies_are_on_another_node_when_there_is_one():
    assert buddies(["a", "b", "c"]) == [1, 2, 0]
    assert buddies(["a", "a", "b"]) == [2, 2, 0]
    assert buddies(["a", "a"]) == [1, 0]  # one node: the next rank (a process loss only)
    assert buddies(["a"]) == [0]


def test_unique_pieces_skip_replicas_on_other_nodes():
    whole = [_m("w", None)]
    assert unique_pieces([whole] * 3, ["a", "b", "c"]) == [[], [], []]  # dp
    # a replica on the same node does not count (it goes with the node)
    assert unique_pieces([whole, whole, []], ["a", "a", "b"]) == [[0], [0], []]
    rows = [[_m("w", (2 * r, 2 * r + 2))] for r in range(3)]
    assert unique_pieces(rows, ["a", "b", "c"]) == [[0], [0], [0]]  # zero3
    # zero1/2: params replicated, optimizer entries owned
    z = [[_m("model/w", None), _m(f"optim/w{r}", None, (2,))] for r in range(2)]
    assert unique_pieces(z, ["a", "b"]) == [[1], [1]]


def test_a_copy_buffer_round_trips_and_its_checksum_catches_a_flipped_byte():
    metas = [_m("w", (2, 5)), ("s", (), "int64", None), ("h", (4, 3), "bfloat16", None)]
    offs, size = layout_offsets(metas)
    assert all(o % 16 == 0 for o in offs) and size == offs[-1] + 32 + 8
    buf = torch.zeros(size, dtype=torch.uint8)
    pieces = _views(buf, metas)
    assert [tuple(p[3].shape) for p in pieces] == [(3, 2), (), (4, 3)]
    pieces[0][3].copy_(torch.arange(6.0).reshape(3, 2))
    pieces[1][3].fill_(41)
    _stamp(buf)
    assert _stamped(buf)
    again = _views(buf, metas)
    assert again[0][3].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert int(again[1][3]) == 41
    buf[offs[0] + 1] ^= 0x10
    assert not _stamped(buf)


def test_copies_settle_only_on_every_ranks_word():
    class _M:
        rank, world, generation = 0, 3, 1

    c = PeerCopies(5, None, _M(), lambda: "a")  # type: ignore[arg-type]
    assert not c.due(0) and not c.due(3) and c.due(5) and c.due(10)
    assert c.flag() == 1.0  # nothing in flight
    c.settle(3.0, 3)  # nothing pending: no-op
    assert c.status()["steps"] == {}
    assert c.restore_pieces(5) == []  # none held here (a rank that joined): it brings none
    assert PeerCopies(0, None, _M(), lambda: None).due(5) is False  # type: ignore[arg-type]
    assert FAILED < -3


def test_a_ranks_word_settles_the_generation_it_was_about_not_the_next_one():
    """The step loop sums the ranks' words on their exchange in the step's control
    all-reduce and reads the sum a step later: by then the generation the words were about
    may be committed and a new one begun. Was: the words "done" of the committed one
    committed the new one, still in flight, in place of the last complete generation; a loss
    then found none and the job restarted from step 0 (zero1/zero2 with
    ``peer_copies_every: 1``, 8 of 13 runs; found by a new user, session 49)."""
    from elastic.worker.peer_copies import _Gen

    class _M:
        rank, world, generation = 0, 2, 1

    def gen(step: int, done: bool) -> _Gen:
        g = _Gen(step, [("model/w", (6, 2), None, torch.zeros(6, 2))])
        if done:
            g.done.set()
        return g

    c = PeerCopies(1, None, _M(), lambda: "a")  # type: ignore[arg-type]
    g11 = gen(11, True)
    c._pending = g11
    words = [c.flag()]  # step 10: g11's exchange done here; the sum is read at step 11
    words.append(c.flag())  # step 11 (g11 still pending: no new one begun)
    c.settle(2 * words.pop(0), 2)  # step 10's sum: g11 committed
    assert c._committed is g11 and c._pending is None
    c._pending = gen(13, False)  # step 12 begins g13, in flight
    words.append(c.flag())
    assert words == [1.0, 0.0]
    c.settle(2 * 1.0, 2)  # step 11's sum, about g11: g13 is not committed by it
    assert c._committed is g11 and c._pending is not None
    assert list(c.status()["steps"]) == [11]
    c.settle(2 * words.pop(), 2)  # step 12's: g13 still in flight
    assert c._committed is g11


def test_copies_memory_counts_own_snapshot_and_wards_and_obeys_the_limit():
    from elastic.worker.peer_copies import copies_memory

    rows = [[_m("w", (2 * r, 2 * r + 2))] for r in range(3)]  # zero3: 16 bytes per rank
    nodes = ["a", "b", "c"]
    ring, uniq = buddies(nodes), unique_pieces(rows, nodes)
    need, on, why = copies_memory(rows, ring, uniq, None)
    assert need == [2 * (16 + 16)] * 3 and on and why == ""  # own + one ward's, twice
    need, on, why = copies_memory(rows, ring, uniq, 63.0)
    assert not on and "over peer_copies_memory_gb=6.3e-08" in why
    assert copies_memory(rows, ring, uniq, 64.0)[1]
    whole = [[_m("w", None)]] * 3  # dp: replicas on other nodes, nothing to copy
    assert copies_memory(whole, ring, unique_pieces(whole, nodes), 1.0)[1:] == (False, "")
    assert copies_memory(rows[:1], [0], [[0]], None)[1] is False  # one rank: no buddy


def test_a_restored_group_takes_copies_at_its_first_boundary():
    """After a restore (``reset``: the old ring's copies mean nothing) the next boundary takes
    a copy, whatever its step; then every k-th again. A second loss before the next multiple
    of k used to find no copy at all."""
    class _M:
        rank, world, generation = 0, 2, 2

    c = PeerCopies(5, None, _M(), lambda: "a")  # type: ignore[arg-type]
    assert not c.due(7)
    c.reset()
    assert c.due(7) and c.due(8) and not c.due(0)  # until a copy begins
    c._pending = object()  # type: ignore[assignment]  # an exchange in flight: begin returns early
    c.begin(None, 7)
    assert not c.due(8) and c.due(10)
    off = PeerCopies(0, None, _M(), lambda: None)  # type: ignore[arg-type]
    off.reset()
    assert not off.due(7)  # copies off: never
