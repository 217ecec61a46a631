"""The worker group's contract: what the controller asks of the job's workers.

``Group`` lists the methods; ``elastic.control.worker_group.WorkerGroup`` implements them on
Ray and ``tests/unit/fake_group.py`` without it. Every failure comes back typed (elastic's
errors, or ``Failure`` records in a ``SegmentPoll``), never as a Ray exception.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from strategies import StrategySpec

from ..failures import Failure

__all__ = ["WorkerRec", "Segment", "SegmentPoll", "DrainNotice", "drain_notices", "drain_reason",
           "Group", "capacity"]


@dataclass
class WorkerRec:
    """One worker actor of the job: its handle, identity, the info it reported, its rank in
    the current generation and its placement-group bundle."""

    handle: Any
    worker_id: int
    info: dict[str, Any] = field(default_factory=dict)
    rank: int = -1
    pg: Any = None
    slot: int = 0  # bundle index in ``pg``


@dataclass
class Segment:
    """A segment of steps running on every worker (one future each)."""

    start: int
    end: int
    running: list[tuple[WorkerRec, Any]]


@dataclass(frozen=True)
class SegmentPoll:
    """Where a running segment stands: ``done`` (every worker returned ``next_step``), or
    ``failures`` (what the workers that ended reported, typed), else still running."""

    done: bool = False
    next_step: int | None = None
    failures: tuple[Failure, ...] = ()
    noticed_by: str = ""  # the first signal of a failure: liveness, collective or actor


@dataclass(frozen=True)
class DrainNotice:
    """A node hosting some of the job's workers is draining: it will go away (a cloud's
    preemption notice, or a drain asked for maintenance). ``deadline`` is when (seconds
    since the epoch; None: no deadline); ``ranks`` are the job's ranks there when seen;
    ``reason`` is Ray's drain reason in words (``preemption``, ``idle termination``) or
    ``maintenance`` for a drain the job was asked for."""

    node_id: str
    ranks: tuple[int, ...]
    deadline: float | None
    reason: str
    message: str = ""
    seen: float = 0.0  # when the job saw it (seconds since the epoch)

    def left_s(self, now: float) -> float | None:
        """Seconds until the deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - now


def drain_notices(drained: dict[str, int], workers: Sequence[WorkerRec],
                  reason_of: Callable[[str], tuple[str, str]],
                  now: float | None = None) -> list[DrainNotice]:
    """Notices for the draining nodes (``{node id: deadline in ms since the epoch, 0 for
    none}``, as Ray's GCS lists them) that host some of ``workers``."""
    hosts: dict[str, list[int]] = {}
    for w in workers:
        hosts.setdefault(str(w.info.get("node_id", "")), []).append(w.rank)
    t = time.time() if now is None else now
    out = []
    for node, deadline_ms in sorted(drained.items()):
        if node in hosts:
            reason, message = reason_of(node)
            out.append(DrainNotice(node, tuple(sorted(hosts[node])),
                                   deadline_ms / 1e3 if deadline_ms else None, reason,
                                   message, t))
    return out


# gcs_pb2.NodeDeathInfo.Reason: what a node's info says it went (or will go) for
_DRAIN_REASONS = {3: "preemption", 4: "idle termination", 1: "expected termination"}


def drain_reason(infos: dict[Any, Any], node: str) -> tuple[str, str]:
    """(reason in words, Ray's message) for draining ``node`` from the GCS's node infos
    (``GcsClient.get_all_node_info()``: node id -> ``GcsNodeInfo``). Ray 2.60 fills a node's
    ``death_info`` only once it is gone; while it drains the reason is "preemption": Ray
    refuses any other kind of drain of a busy node (one hosting this job's workers), and
    its own SIGTERM drain is of that kind too."""
    for nid, info in infos.items():
        if (nid.hex() if hasattr(nid, "hex") else str(nid)) == node:
            death = info.death_info
            return _DRAIN_REASONS.get(int(death.reason), "preemption"), str(death.reason_message)
    return "preemption", ""


class Group(Protocol):
    """The job's workers: placement, membership, segments and typed calls. Methods that
    call workers raise elastic's typed errors (``WorkerLostError``, ``GroupError``,
    ``WorkerError``, ``CheckpointError``...)."""

    workers: list[WorkerRec]
    generation: int

    # placement
    def place(self, n: int, min_workers: int) -> list[WorkerRec]: ...
    def spares_ready(self) -> int: ...
    def spares_starting(self) -> int: ...
    def start_spares(self, n: int) -> None: ...
    def take_spares(self, n: int) -> list[WorkerRec]: ...
    def try_place(self, n: int, timeout_s: float) -> list[WorkerRec]: ...
    def room(self) -> bool: ...
    def trim_slots(self, keep: int) -> int: ...
    # membership
    def form(self) -> tuple[str, int, float]: ...
    def remove(self, dead: Sequence[WorkerRec]) -> None: ...
    def shrink(self, n: int) -> list[WorkerRec]: ...
    def survivors(self, exclude: Sequence[WorkerRec] = ()) -> tuple[list[WorkerRec],
                                                                     list[WorkerRec]]: ...
    # segments
    def start_segment(self, start: int, end: int) -> Segment: ...
    def poll_segment(self, seg: Segment, timeout_s: float) -> SegmentPoll: ...
    def wind_down(self, seg: Segment, timeout_s: float) -> list[WorkerRec]: ...
    def request_stop(self, urgent: bool = False) -> None: ...
    def send_gate(self, gate: Any) -> None: ...
    def drain(self) -> list[list[dict[str, Any]]]: ...
    # state and layouts
    def build(self, spec: StrategySpec) -> list[dict[str, Any]]: ...
    def memory_counts(self, timeout_s: float | None = None) -> list[dict[str, int]]: ...
    def profile(self, batch: int, detail: bool = False,
                workers: Sequence[WorkerRec] | None = None) -> list[dict[str, Any]]: ...
    def profile_terms(self, shares: list[int], rounds: int = 7) -> list[dict[str, Any]]: ...
    def progress(self, timeout_s: float | None = None) -> list[dict[str, Any]]: ...
    def held_keys(self) -> list[dict[str, tuple[tuple[int, ...], str]]]: ...
    def leave(self, workers: Sequence[WorkerRec] | None = None) -> Any: ...
    def snapshot_full(self) -> None: ...
    def finish_pending_step(self, workers: Sequence[WorkerRec]) -> None: ...
    def restore_from_peers(self, spec: StrategySpec,
                           plan: list[tuple[str, int, tuple[int, ...], str]],
                           step: int) -> list[dict[str, Any]]: ...
    def restore_checkpoint(self, spec: StrategySpec, step: int,
                           store: Any = None) -> list[dict[str, Any]]: ...
    def restart_fresh(self, spec: StrategySpec) -> None: ...
    # notices, evacuation, peer copies
    def notices(self) -> list[DrainNotice]: ...
    def drain_node(self, node_id: str, deadline_s: float | None, message: str) -> str: ...
    def release(self, workers: Sequence[WorkerRec]) -> None: ...
    def hand_off(self, leaving: Sequence[int]) -> list[dict[str, Any]]: ...
    def restore_from_pieces(self, spec: StrategySpec, step: int) -> list[dict[str, Any]]: ...
    def copies_status(self) -> list[dict[str, Any]]: ...
    def restore_from_copies(self, spec: StrategySpec, step: int) -> list[dict[str, Any]]: ...
    def checkpoint_poll(self) -> list[dict[str, Any] | None]: ...
    def checkpoint_now(self) -> list[dict[str, Any]]: ...
    def checkpoint_done(self, step: int, committed: bool, generation: int | None = None,
                        seq: int | None = None) -> None: ...
    def final_state(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def capacity(bundle: dict[str, float], total: dict[str, float], free: dict[str, float]) -> str:
    """What the cluster has of each resource a worker needs, and what of it is free: "0 of
    4 CPU free; the rest is held by placement groups (other jobs, idle pooled workers)".
    (Ray's free resources also list a wildcard per placement group bundle, which only hid
    the CPUs in the message.)"""
    parts = ", ".join(f"{free.get(k, 0.0):g} of {total.get(k, 0.0):g} {k} free" for k in bundle)
    held = any(free.get(k, 0.0) < total.get(k, 0.0) for k in bundle)
    return parts + ("; the rest is held by placement groups (other jobs, idle pooled "
                    "workers)" if held else "")
