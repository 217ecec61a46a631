"""Held state: what this rank keeps of the job's state when no layout holds it live.

Two moments need a copy outside the live layout:

* a planned membership change: the old group takes a *full* snapshot (``snapshot_full``), so
  that every entry has a holder on any old rank when the new group is formed;
* ``leave``: the layout is dropped (its references pin the group's sockets), and the state the
  rank held is *parked* as canonical CPU tensors (``park``). If the step's final all-reduce
  failed here after the gradients were complete (``pending_update``), the state with that
  update applied is parked too, so that a roll-forward works after the layout is gone.

Every path after that lays the job out again from held, peer or checkpoint state: a new
layout replaces whatever is held (``clear``, called by ``Layout``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HeldState", "PeerPlan"]

# [(canonical key, the rank that sends it, shape, dtype name)]: restore_from_peers' plan
PeerPlan = list[tuple[str, int, tuple[int, ...], str]]


def _live(strategy: Any) -> dict[str, torch.Tensor]:
    """What a live layout holds whole on this rank (``Strategy.held_state``), or nothing."""
    fn = getattr(strategy, "held_state", None)
    return fn() if fn is not None else {}


class HeldState:
    """The snapshot or parked state of this rank, and the parked state one step on.

    ``lock`` serializes ``leave`` (which parks, on the controller's thread) with
    ``roll_forward``; the actor holds it across the whole leave.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._snapshot: dict[str, torch.Tensor] | None = None  # full (planned change) or
        # parked at leave; kept until the next layout
        self._rolled: dict[str, torch.Tensor] | None = None  # parked state one step on

    @property
    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """The snapshot or parked state, if any (read-only use)."""
        return self._snapshot

    def has_state(self) -> bool:
        return self._snapshot is not None

    def clear(self) -> None:
        """A new layout holds the state: drop the snapshot and any rolled copy."""
        self._snapshot = self._rolled = None

    def park(self, strategy: Any) -> None:
        """Before ``strategy`` is dropped (at leave): keep what it holds, unless a snapshot is
        kept already; with a pending update, finish it on the strategy (local, no
        communication) and keep that state too, for ``roll_forward``. The caller holds
        ``lock``."""
        if self._snapshot is not None:
            return
        self._snapshot = _live(strategy)
        if getattr(strategy, "pending_update", False):
            # the step's final all-reduce failed here after the gradients were complete
            if strategy.finish_pending_step():
                self._rolled = _live(strategy)

    def snapshot_full(self, strategy: Any) -> int:
        """Collective over the current (healthy) group: keep the full canonical state, so
        that a planned membership change can hand every entry to the new group from any old
        rank. Returns the bytes held."""
        self._snapshot = strategy.full_state()
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    def pending(self, strategy: Any) -> bool:
        """Whether a step's update can still be applied here without communication: on the
        live ``strategy``, or (none) to the parked state."""
        if strategy is None:
            return self._rolled is not None
        return bool(getattr(strategy, "pending_update", False))

    def roll_forward(self, strategy: Any) -> bool:
        """Local, after a failure: apply a step whose gradients were complete when its final
        all-reduce failed here (the caller knows a peer applied it), on the live
        ``strategy`` or, with none, by taking the parked state with that update applied.
        Returns whether a step was applied (the data position moves one step on)."""
        with self.lock:
            if strategy is None:
                if self._rolled is None:
                    return False
                self._snapshot, self._rolled = self._rolled, None
                return True
            return bool(getattr(strategy, "finish_pending_step", lambda: False)())

    def held(self, strategy: Any) -> dict[str, torch.Tensor]:
        """Canonical entries this rank holds whole: the snapshot or parked state, else the
        live layout's."""
        return self._snapshot if self._snapshot is not None else _live(strategy)

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
