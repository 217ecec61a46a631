"""The typed calls the controller makes on its workers and their placement, in one place.

``WorkerCalls`` names each call and its arguments; how a call reaches the workers and how
their failures come back typed is its subclass's ``_call`` (``WorkerGroup``: Ray actor
calls, Ray's errors turned into elastic's). Collective calls go to every worker of the
current group at once (``workers=None``), local ones to the workers named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strategies import StrategySpec

from ..ray_connect import bundle_count, pg_ready, remove_bundle
from .group import WorkerRec

__all__ = ["WorkerCalls", "PlacementCalls", "EVEN"]

# calls whose ranks do local work of about the same size (``watch.hung_after``)
EVEN = frozenset({"leave", "finish_pending_step", "held_keys"})


class PlacementCalls:
    """Placement, as the group's own methods: new workers join ``workers``. Delegates to
    ``placement`` (``elastic.control.worker_group.Placement``)."""

    workers: list[WorkerRec]
    placement: Any

    @property
    def use_gpu(self) -> bool:
        return bool(self.placement.use_gpu)

    def place(self, n: int, min_workers: int) -> list[WorkerRec]:
        """Start ``n`` workers in one placement group (``ClusterError`` with the fix if it
        cannot be reserved in time or fewer than ``min_workers`` start)."""
        new: list[WorkerRec] = self.placement.place(n, min_workers)
        self.workers += new
        return new

    def spares_ready(self) -> int:
        return int(self.placement.spares_ready())

    def spares_starting(self) -> int:
        return int(self.placement.spares_starting())

    def start_spares(self, n: int) -> None:
        self.placement.start_spares(n)

    def take_spares(self, n: int) -> list[WorkerRec]:
        """Take up to ``n`` warm spares that are up into the job."""
        new: list[WorkerRec] = self.placement.take_spares(n)
        self.workers += new
        return new

    def trim_slots(self, keep: int) -> int:
        """Give back the free reserved slots beyond ``keep`` (how many more workers the job
        may take): a lost or drained worker's one-bundle group that Ray re-reserved elsewhere
        held a device idle on a shared cluster, while the job ran at its size with a
        replacement. Groups of several bundles stay (Ray frees no single bundle). Returns how
        many were given back."""
        pl = self.placement
        if not (pl.free_slots or pl.draining or pl.lost):
            return 0
        pl.revive()  # (a draining node's bundles are free once it is gone)
        if len(pl.free_slots) <= keep:
            return 0
        used = {id(w.pg) for w in self.workers} | {id(w.pg) for w in pl.warming()}
        spare = [s for s in pl.free_slots if s[0] is not None and id(s[0]) not in used
                 and bundle_count(s[0]) == 1]
        spare.sort(key=lambda s: pg_ready(s[0]))  # those Ray could not re-reserve first
        gone = spare[:len(pl.free_slots) - keep]
        for pg, _ in gone:
            remove_bundle(pg)
        ids = {id(pg) for pg, _ in gone}
        pl.free_slots = [s for s in pl.free_slots if id(s[0]) not in ids]
        return len(gone)

    def try_place(self, n: int, timeout_s: float) -> list[WorkerRec]:
        """Place up to ``n`` more workers within ``timeout_s``; keep what could be placed."""
        new: list[WorkerRec] = self.placement.try_place(n, timeout_s)
        self.workers += new
        return new

    def room(self) -> bool:
        return bool(self.placement.room())


class WorkerCalls:
    """Typed worker calls over ``_call(method, *args, workers=, timeout_s=)``."""

    workers: list[WorkerRec]
    segment_id: int = 0  # the last segment started (``start_segment`` numbers them)

    def _call(self, method: str, *args: Any, workers: Sequence[WorkerRec] | None = None,
              timeout_s: float | None = None) -> list[Any]:
        raise NotImplementedError

    def _tell(self, method: str, *args: Any) -> None:
        raise NotImplementedError

    def request_stop(self, urgent: bool = False) -> None:
        """Ask every worker to stop the last segment started at its next step boundary
        (thread-safe, fire and forget; it holds even where the worker has not begun that
        segment yet). ``urgent`` (a preemption notice): a due checkpoint does not wait for
        a slow upload's commit first."""
        self._tell("request_stop", self.segment_id, urgent)

    def send_gate(self, gate: Any) -> None:
        """Hand every worker a sweep pruner's gate (fire and forget, like a stop)."""
        self._tell("set_gate", gate)

    def build(self, spec: StrategySpec) -> list[dict[str, Any]]:
        """Lay every worker out as ``spec`` (first build or a live switch)."""
        return self._call("build", spec)

    def memory_counts(self, timeout_s: float | None = None) -> list[dict[str, int]]:
        """Each worker's counts (``StepLoop.memory_counts``)."""
        return self._call("memory_counts", timeout_s=timeout_s)

    def profile(self, batch: int, detail: bool = False,
                workers: Sequence[WorkerRec] | None = None) -> list[dict[str, Any]]:
        return self._call("profile", batch, detail, workers=workers)

    def profile_terms(self, shares: list[int], rounds: int = 7) -> list[dict[str, Any]]:
        return self._call("profile_terms", shares, rounds)

    def progress(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return self._call("progress", timeout_s=timeout_s)

    def held_keys(self) -> list[dict[str, tuple[tuple[int, ...], str]]]:
        return self._call("held_keys")

    def leave(self, workers: Sequence[WorkerRec] | None = None,
              collect: bool = True) -> list[dict[str, float]]:
        """Every worker (of ``workers``) leaves its group, parking its state;
        ``collect=False`` for a planned change (no peer is blocked: skip the collection).
        Returns each worker's timings (``Worker.leave``)."""
        return self._call("leave", collect, workers=workers)

    def snapshot_full(self) -> None:
        self._call("snapshot_full")

    def finish_pending_step(self, workers: Sequence[WorkerRec]) -> None:
        self._call("finish_pending_step", workers=workers)

    def restore_from_peers(self, spec: StrategySpec, plan: list[tuple[str, int, tuple[int, ...],
                                                                      str]],
                           step: int) -> list[dict[str, Any]]:
        return self._call("restore_from_peers", spec, plan, step)

    def restore_checkpoint(self, spec: StrategySpec, step: int, store: Any = None
                           ) -> list[dict[str, Any]]:
        return self._call("restore_checkpoint", spec, step, store)

    def restart_fresh(self, spec: StrategySpec) -> None:
        self._call("restart_fresh", spec, None, 0)

    def checkpoint_now(self) -> list[dict[str, Any]]:
        """Every worker begins a checkpoint of the state as it is (collective)."""
        return self._call("checkpoint_now")

    # ------------------------------------------------------------------ evacuation, copies

    def hand_off(self, leaving: Sequence[int]) -> list[dict[str, Any]]:
        """Collective over the current group: the draining ranks ``leaving`` hand the pieces
        only they hold to survivors, checked (``StateMoveError`` when one arrived wrong)."""
        return self._call("hand_off", list(leaving))

    def restore_from_pieces(self, spec: StrategySpec, step: int) -> list[dict[str, Any]]:
        """Collective over the new group: lay out ``spec`` from the pieces the workers hold
        (parked at leave, carried for a draining rank), checked as a switch is."""
        return self._call("restore_from_pieces", spec, step)

    def copies_status(self) -> list[dict[str, Any]]:
        """Each worker's buddy copies: steps and pieces (local, no collective)."""
        return self._call("copies_status", timeout_s=30)

    def restore_from_copies(self, spec: StrategySpec, step: int) -> list[dict[str, Any]]:
        """Collective over the new group: lay out ``spec`` from the snapshots and buddy
        copies of ``step`` (``StateMoveError`` when a copy's checksum does not match)."""
        return self._call("restore_from_copies", spec, step)
