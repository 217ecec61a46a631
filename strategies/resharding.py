"""Live reshard: move a running job's state from one layout into another, each rank sending
only the pieces the other ranks' new layouts keep.

A switch used to gather the whole canonical state on every rank (``full_state``), then let
the new layout keep its part. That moves every byte to every rank and holds a full copy per
rank for a moment. Here the new layout is built first, beside the old one, and asked what it
``needs`` of every entry (whole, dim-0 rows, or nothing); the old layout says what each rank
holds (``local_rows``). From the two maps, known on every rank after one small
``all_gather_object``, every rank derives the same transfer plan: for each new piece, which old
rank sends which rows, preferring the rank itself (no communication at all, e.g. dp -> zero3)
and spreading replicated entries over their holders. The bytes then travel point to point
(``batch_isend_irecv``), each piece read straight from the old layout's tensor and written
straight into its place in the new piece (no send or receive buffers), and each rank loads
what it assembled with ``load_state``.

The proof that the move changed nothing (``check=True``) needs no gather either: every sender
takes the CRC-32C of each piece it sends, read from the *old* layout; after the load, every
receiver takes the CRC-32C of the same rows read back from its *new* layout
(``local_state``); the ranks exchange the two lists and compare them item by item. The
receivers' pieces must also cover every row of every entry the old layout held, and the new
layout must hold nothing the old one did not. ``hash_before``/``hash_after`` digest the two
lists (same on every rank; equal iff every piece matched).

Collective over the default group; both layouts must live on the same group (a switch keeps
its members). Ownership: ``old`` and ``new`` stay the caller's; neither is closed here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .base import Strategy
from .canonical import CanonicalState
from .health import record as record_failure

__all__ = ["ReshardResult", "reshard", "plan_moves", "Move"]


@dataclass(frozen=True)
class Move:
    """Rows ``lo:hi`` (dim 0; a 0-dim entry is one row) of entry ``key`` go from old rank
    ``src`` to new rank ``dst``."""

    key: str
    src: int
    dst: int
    lo: int
    hi: int


@dataclass
class ReshardResult:
    """What a reshard did, the same on every rank except the byte counts (this rank's)."""

    moves: int
    bytes_sent: int
    bytes_kept: int
    hash_before: str
    hash_after: str
    problems: list[str] = field(default_factory=list)


_Held = dict[str, tuple[tuple[int, ...], str, tuple[int, int] | None]]  # key -> shape, dtype, rows
_Wanted = dict[str, tuple[int, int]]


def _rows_count(shape: Sequence[int]) -> int:
    return int(shape[0]) if len(shape) else 1


def _row_bytes(shape: Sequence[int], itemsize: int) -> int:
    n = itemsize
    for d in shape[1:]:
        n *= int(d)
    return n


def plan_moves(held: Sequence[_Held], wanted: Sequence[_Wanted]) -> tuple[list[Move], list[str]]:
    """The transfer plan, a pure function of every rank's held and wanted pieces (so every
    rank computes the same one). ``held[r]``: what old rank r holds, {key: (full shape,
    dtype, rows or None for whole)}; ``wanted[r]``: what new rank r needs, {key: (lo, hi)}.
    A rank takes rows from itself when it holds them; otherwise from the holder that has sent
    the fewest bytes so far (ties: lowest rank). Returns (moves, problems): rows that no old
    rank holds, and old rows that no new rank keeps, are problems."""
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    holders: dict[str, list[tuple[int, int, int]]] = {}
    for r, h in enumerate(held):
        for key, (shape, dtype, rows) in h.items():
            meta.setdefault(key, (tuple(shape), dtype))
            lo, hi = rows if rows is not None else (0, _rows_count(shape))
            holders.setdefault(key, [])
            if hi > lo:
                holders[key].append((r, lo, hi))
    sent = [0] * len(held)
    moves: list[Move] = []
    problems: list[str] = []
    for key in sorted(set(holders) | {k for w in wanted for k in w}):
        if key not in holders:
            problems.append(f"the new layout needs {key}, which the old layout does not hold")
            continue
        shape, dtype = meta[key]
        row_bytes = _row_bytes(shape, torch.empty((), dtype=getattr(torch, dtype)).element_size())
        kept: list[tuple[int, int]] = []
        for dst, w in enumerate(wanted):
            if key not in w:
                continue
            lo, hi = w[key]
            kept.append((lo, hi))
            pos = lo  # (an entry with no rows needs no move)
            while pos < hi:
                cands = [(r, a, b) for r, a, b in holders[key] if a <= pos < b]
                if not cands:
                    problems.append(f"rows {pos}: of {key} (wanted by rank {dst}) are held by "
                                    "no rank")
                    break
                mine = [c for c in cands if c[0] == dst]
                src, _, b = mine[0] if mine else min(cands, key=lambda c: (sent[c[0]], c[0]))
                end = min(hi, b)
                if src != dst:
                    sent[src] += (end - pos) * row_bytes
                moves.append(Move(key, src, dst, pos, end))
                pos = end
        at = 0
        for a, b in sorted(kept):
            if a > at:
                break
            at = max(at, b)
        if at < _rows_count(shape):
            problems.append(f"rows {at}: of {key} are kept by no rank of the new layout")
    return moves, problems


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a piece (a 0-dim piece is its one row)."""
    return t.reshape(1) if t.dim() == 0 else t[lo:hi]


def _crc(t: torch.Tensor) -> int:
    import crc32c

    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return 0
    return int(crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy().data))


def _digest(moves: Sequence[Move], crcs: dict[int, int]) -> str:
    h = hashlib.sha256()
    for i, m in enumerate(moves):
        h.update(f"{m.key}|{m.lo}:{m.hi}|{crcs.get(i, -1)};".encode())
    return h.hexdigest()[:16]


def reshard(old: Strategy, new: Strategy, check: bool = True) -> ReshardResult:
    """Collective over the default group: load ``new`` with the state ``old`` holds, moving
    only what each rank's new layout needs (see the module docstring). With ``check``, the
    returned ``problems`` list every piece of the new layout that differs from the old state
    (the same list on every rank; empty: the move is exact). Raises what a collective raises
    when the group breaks; the old layout is not changed either way."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = old.local_state()
    rows_of = old.local_rows()
    held: _Held = {k: (tuple(shape), str(local[k].dtype).replace("torch.", ""), rows)
                   for k, (shape, rows) in rows_of.items()}
    helds = _all_gather(held, world)
    meta = {k: (shape, getattr(torch, dtype)) for h in helds for k, (shape, dtype, _) in h.items()}
    wanted: _Wanted = {}
    for key, (shape, _dtype) in meta.items():  # what the new layout keeps here, of every entry
        need = new.needs(key, shape)
        if need is True:
            wanted[key] = (0, _rows_count(shape))
        elif need:
            wanted[key] = (int(need[0]), int(need[1]))
    wanteds = _all_gather(wanted, world)
    moves, problems = plan_moves(helds, wanteds)
    if problems:  # the same plan, so the same decision, on every rank: move nothing
        return ReshardResult(len(moves), 0, 0, "", "", problems)

    def old_piece(m: Move) -> torch.Tensor:  # rows m.lo:m.hi of this rank's old piece
        start = (rows_of[m.key][1] or (0, 0))[0]
        return _rows(local[m.key], m.lo - start, m.hi - start)

    def nbytes(m: Move) -> int:
        shape, dtype = meta[m.key]
        return (m.hi - m.lo) * _row_bytes(shape, dtype.itemsize)

    # this rank's new pieces: its own rows are cut from its old pieces, the others' arrive
    # point to point straight into place (row ranges of a contiguous tensor are contiguous)
    device = new.rt.device  # NCCL moves device tensors; gloo CPU ones
    state: CanonicalState = {}
    ops: list[dist.P2POp] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device buffer, CPU place)
    sent_crcs: dict[int, int] = {}
    sent = kept = 0
    for i, m in enumerate(moves):
        if m.src == rank:
            t = old_piece(m)
            if check:
                sent_crcs[i] = _crc(t)
            if m.dst != rank:
                t = t.detach().contiguous().to(device).reshape(-1).view(torch.uint8)
                ops.append(dist.P2POp(dist.isend, t, m.dst, tag=i))
                sent += t.numel()
        if m.dst != rank:
            continue
        shape, dtype = meta[m.key]
        lo, hi = wanteds[rank][m.key]
        if m.key not in state:
            want_shape = shape if not shape else (hi - lo, *shape[1:])
            if m.src == rank and (m.lo, m.hi) == (lo, hi):
                # a view of the old layout (load_state copies what it keeps)
                state[m.key] = old_piece(m).reshape(want_shape)
                kept += nbytes(m)
                continue
            state[m.key] = torch.empty(want_shape, dtype=dtype)
        dest = _rows(state[m.key], m.lo - lo, m.hi - lo)
        if m.src == rank:
            dest.copy_(old_piece(m).reshape(dest.shape))
            kept += nbytes(m)
            continue
        buf = dest.reshape(-1).view(torch.uint8)
        if device.type != "cpu":
            landing.append((torch.empty_like(buf, device=device), buf))
            buf = landing[-1][0]
        ops.append(dist.P2POp(dist.irecv, buf, m.src, tag=i))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            try:
                work.wait()
            except Exception as e:  # raised here, not in torch.distributed: say the group failed
                record_failure(f"reshard transfer: {type(e).__name__}")
                raise
    for dev_buf, place in landing:
        place.copy_(dev_buf)
    del ops, landing
    for key, (lo, hi) in wanteds[rank].items():  # entries with no rows
        if key not in state and key in meta:
            shape, dtype = meta[key]
            state[key] = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
    new.load_state(state)
    del state
    if not check:
        return ReshardResult(len(moves), sent, kept, "", "", problems)
    # read every piece back from the new layout and compare it with what its sender held
    now, now_rows = new.local_state(), new.local_rows()
    got_crcs: dict[int, int] = {}
    mine: list[str] = []
    for i, m in enumerate(moves):
        if m.dst != rank:
            continue
        piece = now.get(m.key)
        if piece is None:
            mine.append(f"rank {rank}'s new layout lacks {m.key}")
            continue
        start = (now_rows.get(m.key, ((), None))[1] or (0, 0))[0]
        got_crcs[i] = _crc(_rows(piece, m.lo - start, m.hi - start))
    mine += [f"rank {rank}'s new layout holds {k}, which the old state has not"
             for k in sorted(set(now) - set(meta))]
    sent_all: dict[int, int] = {}
    got_all: dict[int, int] = {}
    for sent_r, got_r, probs_r in _all_gather((sent_crcs, got_crcs, mine), world):
        sent_all.update(sent_r)
        got_all.update(got_r)
        problems += probs_r
    for i, m in enumerate(moves):
        if sent_all.get(i) != got_all.get(i):
            problems.append(f"rank {m.dst} holds rows {m.lo}:{m.hi} of {m.key} different from "
                            f"what rank {m.src} held")
    before, after = _digest(moves, sent_all), _digest(moves, got_all)
    return ReshardResult(len(moves), sent, kept, before, after, problems)


def _all_gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out
