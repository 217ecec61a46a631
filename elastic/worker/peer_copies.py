"""Peer redundancy: every k steps each rank's share of the state that no rank on another node
holds is copied into a *buddy* rank's host memory, on another node, checksummed.

After an unannounced loss under a sharded layout (zero1/2/3, pipelines without dp replicas)
no survivor holds the lost shard, so the state used to come from the last checkpoint. With
copies, the survivors' memory holds the whole state as of the last copy: each rank's own
snapshot at that step, and for a lost rank the copy its buddy keeps. The job goes back to
that step (at most k steps run again) and reads no storage (``restore`` below; the
controller decides, ``clusters.policy.InPlaceRecovery``). A copy whose checksum does not
match, a step some piece is missing at (a rank and its buddy lost together, a copy still in
flight) falls back to the checkpoint.

How (``begin`` at the step boundary after every k-th step, and at the first one after a
restore, on every rank alike; ``restored`` at the end of every restore):

* once per layout and group, every rank says where it runs and which pieces it holds (one
  ``all_gather_object``); every rank derives the same buddy ring (``buddies``: the next rank
  on another node) and which of its pieces need a copy (``unique``: no rank on another node
  holds those rows; dp replicas and ZeRO-1/2's replicated parameters need none). If the
  copies would need more host memory than ``peer_copies_memory_gb``, they are off on every
  rank (said in the step's metrics);
* the rank copies its whole local state to host memory (its *own snapshot*: the pieces that
  need a copy are laid out in one buffer, 16-byte aligned, with a CRC-32C at its end);
* a background thread sends that buffer to the buddy and receives its wards' buffers on a
  gloo group of their own (``Membership.copies_group``), and checks each received CRC;
* the step's control all-reduce carries each rank's word on its exchange (``flag``); when
  every rank said "done" at the same step, every rank commits that generation (``settle``)
  and drops the previous one; when any said "failed", every rank drops the new one. Until
  then the previous generation is kept, so a loss in the middle of an exchange still finds
  a complete one, and no rank starts another exchange (the decision is the same on every
  rank, since they read the same sums at the same step).

After a restore (from buddies' copies, peers, pieces handed off, a checkpoint) the old
ring's copies are dropped: the new group pairs its ranks anew on another layout (a
replacement holds none; a lost rank's shard sat on one survivor only), and keeping them
beside the new ring's would take a third generation's memory. ``restored``, the last part of
every restore on every rank of the new group, takes the restored state's copies at once and
commits them before the restore returns (one exchange of each rank's unique pieces, on the
restoring thread): ``status`` holds the restored step before any step trains, so a second
loss right after a recovery (a wave of reclaims) comes back to that step from the buddies.
Before, the first copy after a restore began only after the first step's compute and was
reported when its exchange ended (seconds for a large shard): a second loss in between found
no copy and went back to the checkpoint, or to step 0 without one. The first step boundary
still takes a copy in the background (``due``): a second loss a few steps later runs fewer
steps again.

Host memory per rank: its own snapshot plus its wards' copies, twice during an exchange.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import StateMoveError
from .handoff import PieceMeta, covered, crc32c_of
from .held_state import Piece
from .membership import Membership

__all__ = ["PeerCopies", "buddies", "unique_pieces", "layout_offsets", "copies_memory"]

_ALIGN = 16
_TAG = 7_700
FAILED = -1.0e6  # a rank's exchange failed (see ``flag``)


def buddies(nodes: Sequence[str | None]) -> list[int]:
    """Each rank's buddy: the next rank (cyclically) on another node, else the next rank."""
    n = len(nodes)
    out = []
    for r in range(n):
        nxt = next((b for b in ((r + i) % n for i in range(1, n)) if nodes[b] != nodes[r]),
                   (r + 1) % n)
        out.append(nxt)
    return out


def unique_pieces(metas: Sequence[Sequence[PieceMeta]], nodes: Sequence[str | None]
                  ) -> list[list[int]]:
    """Per rank, the indices of its pieces that no rank on another node holds (rows
    included): those need a copy."""
    out = []
    for r, ms in enumerate(metas):
        have: dict[str, list[tuple[int, int]]] = {}
        for o, others in enumerate(metas):
            if nodes[o] == nodes[r]:  # this rank itself, or a rank lost with it
                continue
            for key, shape, _, rows in others:
                have.setdefault(key, []).append(_span(shape, rows))
        out.append([i for i, (key, shape, _, rows) in enumerate(ms)
                    if not covered(_span(shape, rows), have.get(key, []))])
    return out


def _span(shape: Sequence[int], rows: tuple[int, int] | None) -> tuple[int, int]:
    return rows if rows is not None else (0, int(shape[0]) if len(shape) else 1)


def _piece_nbytes(m: PieceMeta) -> int:
    key, shape, dtype, rows = m
    lo, hi = _span(shape, rows)
    n = (hi - lo) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape[1:]:
        n *= int(d)
    return n


def copies_memory(metas: Sequence[Sequence[PieceMeta]], ring: Sequence[int],
                  uniq: Sequence[Sequence[int]], limit: float | None
                  ) -> tuple[list[int], bool, str]:
    """Host bytes the copies take on each rank (its own snapshot of what it holds and its
    wards' copies of their unique pieces, each kept twice: the committed copy and the one in
    flight), whether copies are on (some piece has no replica on another node, more than one
    rank, and no rank over ``limit`` bytes), and why they are off when over the limit."""
    world = len(metas)
    need = [2 * (sum(_piece_nbytes(m) for m in metas[r])
                 + sum(_piece_nbytes(metas[w][i]) for w in range(world)
                       if ring[w] == r and w != r for i in uniq[w]))
            for r in range(world)]
    on = world > 1 and any(uniq)
    if on and limit is not None and max(need) > limit:
        return need, False, (f"peer copies off: they need up to {max(need) / 1e9:.2f} GB of "
                             f"host memory per worker, over peer_copies_memory_gb="
                             f"{limit / 1e9:g}")
    return need, on, ""


def layout_offsets(metas: Sequence[PieceMeta]) -> tuple[list[int], int]:
    """Byte offsets of ``metas`` in one buffer (16-byte aligned) and the buffer's size,
    with 8 bytes at the end for the CRC."""
    offs, at = [], 0
    for m in metas:
        offs.append(at)
        at += -(-_piece_nbytes(m) // _ALIGN) * _ALIGN
    return offs, at + 8


def _views(buf: torch.Tensor, metas: Sequence[PieceMeta]) -> list[Piece]:
    offs, _ = layout_offsets(metas)
    out: list[Piece] = []
    for (key, shape, dtype, rows), off in zip(metas, offs, strict=True):
        lo, hi = _span(shape, rows)
        piece_shape = (hi - lo, *shape[1:]) if shape else ()
        n = _piece_nbytes((key, shape, dtype, rows))
        t = buf[off:off + n].view(getattr(torch, dtype)).reshape(piece_shape)
        out.append((key, tuple(shape), rows, t))
    return out


def _crc_of_payload(buf: torch.Tensor) -> int:
    return crc32c_of(buf[:-8])


def _stamp(buf: torch.Tensor) -> int:
    crc = _crc_of_payload(buf)
    buf[-8:].view(torch.int64)[0] = crc
    return crc


def _stamped(buf: torch.Tensor) -> bool:
    return int(buf[-8:].view(torch.int64)[0]) == _crc_of_payload(buf)


@dataclass
class _Layout:
    """What the ranks agreed about the current layout and group."""

    key: tuple[int, int]  # (id of the layout, group generation)
    buddy: int
    wards: list[int]
    unique: list[int]  # indices of this rank's pieces that need a copy
    ward_metas: dict[int, list[PieceMeta]]
    on: bool
    why_off: str = ""


@dataclass
class _Gen:
    """One generation of copies: this rank's own snapshot at ``step`` and its wards'."""

    step: int
    own: list[Piece]
    copies: dict[int, tuple[list[PieceMeta], torch.Tensor]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    verified: dict[int, bool] = field(default_factory=dict)
    rank: int = -1
    payload: torch.Tensor | None = None  # the own snapshot's buffer (stamped with its CRC)
    n_payload: int = 0  # ``own``'s first pieces, views of ``payload``; the rest replicated
    kept: list[int] = field(default_factory=list)  # the rest's CRCs (the exchange's thread)


class PeerCopies:
    """This rank's buddy copies (see the module docstring). ``begin``, ``flag`` and
    ``settle`` run on the step loop's thread; ``status`` and ``restore_pieces`` on the
    actor's, between segments."""

    def __init__(self, every: int, memory_gb: float | None, membership: Membership,
                 node_id: Callable[[], str | None]) -> None:
        self.every = max(0, int(every))
        self._limit = None if memory_gb is None else float(memory_gb) * 1e9
        self._m = membership
        self._node_id = node_id
        self._layout: _Layout | None = None
        self._committed: _Gen | None = None
        self._pending: _Gen | None = None
        # the generation each step's word was about (``flag``), in step order: the control
        # all-reduce is settled a step later, when another generation may be pending
        self._flagged: deque[_Gen | None] = deque()
        self._fresh = False  # a restore reset the copies: the next boundary takes one
        self.note: str | None = None  # said once in the step metrics (copies turned off)

    def due(self, next_step: int) -> bool:
        """Whether a copy is taken of the state at ``next_step``: after every k-th step, and
        at the first boundary after a restore (every rank of the new group was reset by the
        same collective, so all agree): the restore's own copy (``restored``) covers the
        restored step; this one, in the background, the first step trained after it."""
        return self.every > 0 and next_step > 0 and (self._fresh or next_step % self.every == 0)

    # ------------------------------------------------------------------ taking copies

    def begin(self, strategy: Any, next_step: int, wait: bool = False) -> None:
        """Collective over the default group (every rank at the same step): snapshot this
        rank's state at ``next_step`` and start exchanging the copies in the background
        (``wait``: on this thread, done when this returns). A previous exchange still in
        flight is let finish first."""
        from strategies import layout_pieces

        self._fresh = False
        if self._pending is not None:  # the last exchange is not settled yet (the same on
            return  # every rank: it is settled through the step's control all-reduce)
        pieces = layout_pieces(strategy)
        lay = self._agree(strategy, pieces)
        if not lay.on:
            return
        metas = [_meta(p) for p in pieces]
        uniq = [metas[i] for i in lay.unique]
        _, size = layout_offsets(uniq)
        payload = torch.zeros(size, dtype=torch.uint8)
        own_views = _views(payload, uniq)
        for (_, _, _, dst), i in zip(own_views, lay.unique, strict=True):
            dst.copy_(pieces[i][3].detach().reshape(dst.shape))
        others = [(k, s, r, t.detach().to("cpu", copy=True))
                  for n, (k, s, r, t) in enumerate(pieces) if n not in set(lay.unique)]
        gen = _Gen(next_step, own_views + others, rank=self._m.rank, payload=payload,
                   n_payload=len(own_views))
        recv = {w: torch.empty(layout_offsets(lay.ward_metas[w])[1], dtype=torch.uint8)
                for w in lay.wards}
        gen.copies = {w: (lay.ward_metas[w], buf) for w, buf in recv.items()}
        self._pending = gen
        args = (gen, self._m.copies_group, payload, lay.buddy, recv)
        if wait:
            self._exchange(*args)
            return
        threading.Thread(target=self._exchange, args=args, daemon=True,
                         name="elastic-peer-copies").start()

    def _agree(self, strategy: Any, pieces: list[Piece]) -> _Layout:
        key = (id(strategy), self._m.generation)
        if self._layout is not None and self._layout.key == key:
            return self._layout
        metas = [_meta(p) for p in pieces]
        world = self._m.world
        both: list[Any] = [None] * world
        dist.all_gather_object(both, (self._node_id(), metas))
        nodes = [b[0] for b in both]
        all_metas = [b[1] for b in both]
        ring = buddies(nodes)
        uniq = unique_pieces(all_metas, nodes)
        rank = self._m.rank
        wards = [r for r in range(world) if ring[r] == rank and r != rank and uniq[r]]
        sends = bool(uniq[rank]) and ring[rank] != rank
        ward_metas = {w: [all_metas[w][i] for i in uniq[w]] for w in wards}
        _, on, why = copies_memory(all_metas, ring, uniq, self._limit)
        if why:
            self.note = why
        self._layout = _Layout(key, ring[rank], wards, uniq[rank] if sends else [],
                               ward_metas, on, why)
        return self._layout

    def _exchange(self, gen: _Gen, pg: Any, payload: torch.Tensor, buddy: int,
                  recv: dict[int, torch.Tensor]) -> None:
        try:
            _stamp(payload)
            gen.kept = [crc32c_of(t) for _, _, _, t in gen.own[gen.n_payload:]]
            works = []
            if payload.numel() > 8 and buddy != self._m.rank:
                works.append(pg.send([payload], buddy, _TAG))
            for w, buf in recv.items():
                works.append(pg.recv([buf], w, _TAG))
            for work in works:
                work.wait()
            gen.verified = {w: _stamped(buf) for w, buf in recv.items()}
            if not all(gen.verified.values()):
                gen.error = "a copy arrived different from what its rank sent"
        except Exception as e:  # noqa: BLE001 - a peer lost mid-exchange: this gen is void
            gen.error = f"{type(e).__name__}: {e}"
        finally:
            gen.done.set()

    def flag(self) -> float:
        """This rank's word on its exchange, for the step's control all-reduce (a sum): 1
        when it is done and sound (or none is in flight), 0 while in flight, a large
        negative number when it failed."""
        p = self._pending
        self._flagged.append(p)
        if p is None or (p.done.is_set() and p.error is None):
            return 1.0
        return FAILED if p.done.is_set() else 0.0

    def settle(self, total: float, world: int) -> None:
        """Every rank's word, summed (the same on every rank at the same step): all done,
        the pending generation replaces the committed one; any failed, it is dropped (its
        own snapshot stays usable until then). Otherwise it is still in flight. Only for the
        generation the words were about (the all-reduce is read a step after ``flag``):
        was, the words "done" said of one generation committed the next one, begun since
        and in flight, in place of the last complete one; a loss then found no complete
        generation and the job restarted from its checkpoint, or from step 0 (8 of 13 runs
        of zero1/zero2 with ``peer_copies_every: 1``, found by a new user, session 49)."""
        flagged = self._flagged.popleft() if self._flagged else None
        if self._pending is None or flagged is not self._pending:
            return
        if total >= world - 0.5:
            self._committed, self._pending = self._pending, None
        elif total < -0.5:
            self._pending = None

    # ------------------------------------------------------------------ after a loss

    def status(self) -> dict[str, Any]:
        """Local: per step that a generation is at, the pieces this rank can offer there
        (its own snapshot, and its wards' copies whose checksum matched): the controller
        finds a step at which the survivors hold every entry."""
        out: dict[int, list[tuple[str, tuple[int, ...], tuple[int, int] | None]]] = {}
        for gen in (self._pending, self._committed):  # (a committed one wins its step)
            if gen is None or not gen.done.is_set():
                continue
            have = [(k, s, r) for k, s, r, _ in gen.own]
            for w, (metas, _) in gen.copies.items():
                if gen.verified.get(w):
                    have += [(k, s, r) for k, s, _, r in metas]
            out[gen.step] = have
        return {"steps": out, "rank": self._m.rank,
                "bytes": sum(_gen_bytes(g) for g in (self._committed, self._pending) if g)}

    def restore_pieces(self, step: int) -> list[Piece]:
        """This rank's pieces at ``step``: its own snapshot and its wards' copies, every
        checksum verified again (its own too: host memory can go bad as a copy's can); none
        when it holds nothing at that step (a replacement or a spare that joined: the
        pieces the others hold must cover the state, which the restore checks).
        ``StateMoveError`` when bytes changed since they were taken."""
        gen = next((g for g in (self._committed, self._pending)
                    if g is not None and g.done.is_set() and g.step == step), None)
        if gen is None:
            return []
        if (gen.payload is not None and gen.payload.numel() > 8 and not _stamped(gen.payload)
                or len(gen.kept) != len(gen.own) - gen.n_payload
                or any(crc32c_of(t) != c for (_, _, _, t), c in zip(
                    gen.own[gen.n_payload:], gen.kept, strict=True))):
            raise StateMoveError(f"rank {gen.rank}'s own snapshot of step {step} does not "
                                 "match its checksum (host memory changed)")
        out = list(gen.own)
        for w, (metas, buf) in gen.copies.items():
            if not gen.verified.get(w):
                continue
            if not _stamped(buf):
                raise StateMoveError(f"the copy of rank {w}'s state (step {step}) held by "
                                     f"rank {gen.rank} does not match its checksum")
            out += _views(buf, metas)
        return out

    def corrupt(self) -> bool:
        """Test aid (the ``corrupt_copy`` fault): flip a byte of a held copy."""
        for gen in (self._committed, self._pending):
            for _, buf in (gen.copies.values() if gen else ()):
                if buf.numel() > 8:
                    buf[0] ^= 0xFF
                    return True
        return False

    def reset(self) -> None:
        """A new layout from a restore: copies of earlier ranks and steps mean nothing now;
        the next step boundary takes fresh ones (``restored`` takes them at once)."""
        self._committed = self._pending = None
        self._flagged.clear()
        self._layout = None
        self._fresh = True

    def restored(self, strategy: Any, step: int) -> dict[str, Any]:
        """Collective over the new group, the last part of every restore (every rank, the
        same ``step``: the state's position): drop the old ring's copies (``reset``), then
        take the restored state's, exchange them on this thread and commit them when every
        rank's arrived sound (``all_ranks``), so ``status`` holds ``step`` before the
        restore returns and a second loss before any step trains comes back to ``step``
        from the buddies. A failed exchange is dropped on every rank (the first step
        boundary's copy is then the first); a lost peer fails the restore as its other
        collectives would. Nothing at step 0 (the seeded model: a loss there loses
        nothing). Returns ``copies_s`` and ``copies_bytes`` (this rank's own snapshot and
        its wards' copies), or nothing when copies are off."""
        self.reset()
        if self.every <= 0 or step <= 0 or strategy is None:
            return {}
        t0 = time.perf_counter()
        self.begin(strategy, step, wait=True)
        gen, self._pending = self._pending, None
        self._fresh = True  # the first boundary takes one still (``due``)
        if gen is None:  # off on every rank alike (one rank, nothing unique, memory limit)
            return {}
        if self._m.all_ranks(gen.error is None):
            self._committed = gen
        return {"copies_s": time.perf_counter() - t0, "copies_bytes": _gen_bytes(gen)}


def _meta(p: Piece) -> PieceMeta:
    key, shape, rows, t = p
    return (key, tuple(shape), str(t.dtype).replace("torch.", ""), rows)


def _gen_bytes(g: _Gen) -> int:
    own = sum(t.numel() * t.element_size() for _, _, _, t in g.own)
    return own + sum(buf.numel() for _, buf in g.copies.values())
