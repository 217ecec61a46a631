"""Held state: what this rank keeps of the job's state when no layout holds it live.

Three moments need a copy outside the live layout:

* a planned membership change: the old group takes a *full* snapshot (``snapshot_full``), so
  that every entry has a holder on any old rank when the new group is formed;
* ``leave``: the layout is dropped (its references pin the group's sockets), and the state the
  rank held is *parked* as canonical CPU pieces (``park``): whole entries, and under sharded
  layouts its dim-0 rows. If the step's final all-reduce failed here after the gradients were
  complete (``pending_update``), the state with that update applied is parked too, so that a
  roll-forward works after the layout is gone;
* an evacuation: a draining rank hands the pieces only it holds to a survivor before its node
  goes (``carried``, at the same step as the parked state).

Every path after that lays the job out again from held, peer or checkpoint state: a new
layout replaces whatever is held (``clear``, called by ``Layout``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HeldState", "PeerPlan", "Piece", "piece_bytes", "whole_entries"]

# [(canonical key, the rank that sends it, shape, dtype name)]: restore_from_peers' plan
PeerPlan = list[tuple[str, int, tuple[int, ...], str]]
# (canonical key, the entry's full shape, its dim-0 rows or None for all, those rows)
Piece = tuple[str, tuple[int, ...], tuple[int, int] | None, torch.Tensor]


def piece_bytes(pieces: list[Piece]) -> int:
    return sum(t.numel() * t.element_size() for _, _, _, t in pieces)


def whole_entries(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """The pieces that are whole entries, by key."""
    return {k: t for k, _, rows, t in pieces if rows is None}


def _copies(strategy: Any) -> list[Piece]:
    """CPU copies of what a live layout holds on this rank: its pieces (whole entries and
    dim-0 rows), or, for a layout that says only what it holds whole, those entries."""
    if hasattr(strategy, "local_rows"):
        from strategies import layout_pieces

        return [(k, shape, rows, t.detach().to("cpu", copy=True))
                for k, shape, rows, t in layout_pieces(strategy)]
    fn = getattr(strategy, "held_state", None)
    whole = fn() if fn is not None else {}
    return [(k, tuple(t.shape), None, t) for k, t in whole.items()]


def _live(strategy: Any) -> dict[str, torch.Tensor]:
    """What a live layout holds whole on this rank (``Strategy.held_state``), or nothing."""
    fn = getattr(strategy, "held_state", None)
    return fn() if fn is not None else {}


class HeldState:
    """The snapshot or parked pieces of this rank, the parked pieces one step on, and the
    pieces carried for a draining rank.

    ``lock`` serializes ``leave`` (which parks, on the controller's thread) with
    ``roll_forward``; the actor holds it across the whole leave.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._pieces: list[Piece] | None = None  # full (planned change) or parked at leave;
        # kept until the next layout
        self._rolled: list[Piece] | None = None  # parked pieces one step on
        self._rolling = False  # ``park`` is applying a pending update (no lock: ``pending``)
        self.carried: list[Piece] = []  # handed over by a draining rank (same step)

    @property
    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """The whole entries of the snapshot or parked state, if any (read-only use)."""
        return whole_entries(self._pieces) if self._pieces is not None else None

    def has_state(self) -> bool:
        return self._pieces is not None

    def clear(self) -> None:
        """A new layout holds the state: drop the snapshot, any rolled copy and carried
        pieces."""
        self._pieces = self._rolled = None
        self.carried = []

    def park(self, strategy: Any) -> None:
        """Before ``strategy`` is dropped (at leave): keep what it holds, unless a snapshot is
        kept already; with a pending update, finish it on the strategy (local, no
        communication) and keep that state too, for ``roll_forward``. The caller holds
        ``lock``."""
        if self._pieces is not None:
            return
        pending = bool(getattr(strategy, "pending_update", False))
        self._rolling = pending  # ``pending`` says so while the update is applied here
        try:
            self._pieces = _copies(strategy)
            # the step's final all-reduce failed here after the gradients were complete
            if pending and strategy.finish_pending_step():
                self._rolled = _copies(strategy)
        finally:
            self._rolling = False

    def snapshot_full(self, strategy: Any) -> int:
        """Collective over the current (healthy) group: keep the full canonical state, so
        that a planned membership change can hand every entry to the new group from any old
        rank. Returns the bytes held."""
        return self.hold_full(strategy.full_state())

    def hold_full(self, full: dict[str, torch.Tensor]) -> int:
        """Keep ``full`` (the whole canonical state) as this rank's held state; returns its
        bytes."""
        self._pieces = [(k, tuple(t.shape), None, t) for k, t in full.items()]
        return piece_bytes(self._pieces)

    def drop_snapshot(self) -> None:
        """The live layout trains on: a full snapshot taken for a membership change that did
        not happen (a resize that gave up) is of an earlier step; kept, ``park`` would keep
        it at the next leave and serve it as this rank's state (the steps since, lost
        silently). Pieces carried for a draining rank stay."""
        with self.lock:
            self._pieces = self._rolled = None

    def pending(self, strategy: Any) -> bool:
        """Whether a step's update can still be applied here without communication: on the
        live ``strategy``, or to the parked state. Takes no lock: the controller's pings
        ask it while a leave parks a large state."""
        # in this order: ``park`` applies the update, then sets ``_rolled``, then clears
        # ``_rolling``, so a read between any two of its steps sees one of the three
        if strategy is not None and bool(getattr(strategy, "pending_update", False)):
            return True
        return self._rolling or self._rolled is not None

    def roll_forward(self, strategy_of: Callable[[], Any]) -> bool:
        """Local, after a failure: apply a step whose gradients were complete when its final
        all-reduce failed here (the caller knows a peer applied it), on the live strategy
        (``strategy_of()``, read under ``lock``: a leave on the other thread may be parking
        it) or, with none, by taking the parked state with that update applied. Returns
        whether a step was applied (the data position moves one step on)."""
        with self.lock:
            strategy = strategy_of()
            if strategy is None:
                if self._rolled is None:
                    return False
                self._pieces, self._rolled = self._rolled, None
                return True
            return bool(getattr(strategy, "finish_pending_step", lambda: False)())

    def pieces(self, strategy: Any) -> list[Piece]:
        """Every piece this rank holds at its data position: parked (else the live layout's,
        as views) plus those carried for a draining rank."""
        if self._pieces is not None:
            own = self._pieces
        elif strategy is not None and hasattr(strategy, "local_rows"):
            from strategies import layout_pieces

            own = layout_pieces(strategy)
        else:
            own = []
        return list(own) + list(self.carried)

    def held(self, strategy: Any) -> dict[str, torch.Tensor]:
        """Canonical entries this rank holds whole: the snapshot or parked state (with what
        it carries), else the live layout's."""
        if self._pieces is not None:
            return whole_entries(self._pieces + self.carried)
        return _live(strategy)

    def keys(self, strategy: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """Local: the canonical keys this rank holds whole, with shape and dtype name."""
        return {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""))
                for k, v in self.held(strategy).items()}

    def from_peers(self, plan: PeerPlan, strategy: Any, rank: int, device: torch.device
                   ) -> tuple[dict[str, torch.Tensor], int]:
        """Collective over the new group: every key of ``plan`` is broadcast from the rank
        that holds it. Returns the full canonical state (CPU) and the bytes moved."""
        held = self.held(strategy)
        state: dict[str, torch.Tensor] = {}
        nbytes = 0
        for key, src, shape, dtype in plan:  # NCCL needs device tensors; gloo takes CPU ones
            if rank == src:
                t = held[key].to(device).contiguous()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src=src)
            state[key] = t.cpu()
            nbytes += t.numel() * t.element_size()
        return state, nbytes
