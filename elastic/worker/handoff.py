"""The hand-off of an evacuation: before a draining node goes, its ranks send the pieces of
the state that only they hold to surviving ranks, which keep them in host memory.

At a step boundary, over the old group (still whole): every rank says which pieces it holds
(key, full shape, dim-0 rows); every rank derives the same plan (``handoff_plan``, pure):
each piece of a draining rank that no surviving rank holds goes to the survivor that has
received the fewest bytes so far. The bytes travel point to point; each receiver checks every
piece against the CRC-32C its sender took, and the ranks agree that every piece arrived
intact before any of them keeps one. Under dp (and pipeline x dp) every piece has a replica
on a survivor: nothing moves. Only this step needs the draining node: what follows (a new
group of the survivors, the new layout loaded from the pieces with ``move_pieces``) does not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import StateMoveError
from .held_state import Piece, piece_bytes

__all__ = ["PieceMeta", "handoff_plan", "hand_off", "crc32c_of", "covered"]

# (key, full shape, dtype name, rows or None for the whole entry): what a piece is, not its bytes
PieceMeta = tuple[str, tuple[int, ...], str, tuple[int, int] | None]


def _span(shape: Sequence[int], rows: tuple[int, int] | None) -> tuple[int, int]:
    return rows if rows is not None else (0, int(shape[0]) if len(shape) else 1)


def covered(want: tuple[int, int], have: Sequence[tuple[int, int]]) -> bool:
    """Whether the row ranges ``have`` cover ``want`` = (lo, hi)."""
    at, hi = want
    for a, b in sorted(have):
        if a > at:
            break
        at = max(at, b)
    return at >= hi


def _nbytes(m: PieceMeta) -> int:
    key, shape, dtype, rows = m
    lo, hi = _span(shape, rows)
    n = (hi - lo) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape[1:]:
        n *= int(d)
    return n


def handoff_plan(metas: Sequence[Sequence[PieceMeta]], leaving: Sequence[int]
                 ) -> list[tuple[int, int, int]]:
    """(source rank, index of the piece on it, destination rank) for every piece of a
    ``leaving`` rank that no staying rank holds (rows included), each to the staying rank
    that has received the fewest bytes so far (ties: lowest rank). The same on every rank."""
    gone = set(leaving)
    stay = [r for r in range(len(metas)) if r not in gone]
    if not stay:
        return []
    have: dict[str, list[tuple[int, int]]] = {}
    for r in stay:
        for key, shape, _, rows in metas[r]:
            have.setdefault(key, []).append(_span(shape, rows))
    got = dict.fromkeys(stay, 0)
    plan: list[tuple[int, int, int]] = []
    for r in sorted(gone):
        for i, m in enumerate(metas[r]):
            if covered(_span(m[1], m[3]), have.get(m[0], [])):
                continue  # a survivor holds these rows already (a replica)
            dst = min(stay, key=lambda d: (got[d], d))
            got[dst] += _nbytes(m)
            plan.append((r, i, dst))
    return plan


def crc32c_of(t: torch.Tensor) -> int:
    import crc32c

    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return 0
    return int(crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy().data))


def _all_gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def hand_off(pieces: Sequence[Piece], leaving: Sequence[int], device: torch.device
             ) -> tuple[list[Piece], dict[str, Any]]:
    """Collective over the current group: the pieces only ``leaving`` ranks hold go to
    survivors (see the module docstring). Returns the pieces this rank received (CPU) and
    what it did (``bytes_sent``, ``bytes_received``, ``pieces``, ``seconds``). Raises
    ``StateMoveError`` on every rank when any piece arrived different from what was sent."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: list[PieceMeta] = [(k, tuple(shape), str(t.dtype).replace("torch.", ""), rows)
                             for k, shape, rows, t in pieces]
    metas = _all_gather(mine, world)
    plan = handoff_plan(metas, leaving)
    ops: list[dist.P2POp] = []
    received: list[tuple[int, Piece, torch.Tensor]] = []  # (plan index, piece, landing)
    sent_crcs: dict[int, int] = {}
    sent = 0
    for n, (src, i, dst) in enumerate(plan):
        if src == rank:
            t = pieces[i][3]
            sent_crcs[n] = crc32c_of(t)
            buf = t.detach().contiguous().to(device).reshape(-1).view(torch.uint8)
            ops.append(dist.P2POp(dist.isend, buf, dst, tag=n))
            sent += buf.numel()
        elif dst == rank:
            key, shape, dtype, rows = metas[src][i]
            lo, hi = _span(shape, rows)
            out = torch.empty((hi - lo, *shape[1:]) if shape else (), dtype=getattr(torch, dtype))
            land = out.reshape(-1).view(torch.uint8)
            if device.type != "cpu":
                land = torch.empty_like(land, device=device)
            ops.append(dist.P2POp(dist.irecv, land, src, tag=n))
            received.append((n, (key, tuple(shape), rows, out), land))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    got: dict[int, int] = {}
    for n, piece, land in received:
        if land.device.type != "cpu":
            piece[3].reshape(-1).view(torch.uint8).copy_(land)
        got[n] = crc32c_of(piece[3])
    sent_all: dict[int, int] = {}
    for s in _all_gather(sent_crcs, world):
        sent_all.update(s)
    bad = [n for n, c in got.items() if sent_all.get(n) != c]
    flags = _all_gather(len(bad), world)
    if any(flags):
        raise StateMoveError(f"the hand-off of a draining rank's pieces failed its check "
                             f"({sum(flags)} piece(s) arrived different from what was sent)")
    kept = [p for _, p, _ in received]
    return kept, {"bytes_sent": sent, "bytes_received": piece_bytes(kept),
                  "pieces": len(plan), "seconds": time.perf_counter() - t0}
