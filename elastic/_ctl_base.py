"""What the controller's parts share: its states, the record of one worker, the state the
parts read and write (declared in ``ControllerBase``), and small Ray helpers.

The controller (``elastic.controller.Controller``) is one state machine written as a few
sections, one module each: placement and scaling (``_ctl_placement``), layouts and switches
(``_ctl_layout``), checkpoints (``_ctl_checkpoints``) and recovery (``_ctl_recovery``). Each
section is a mixin over ``ControllerBase``; only ``Controller`` combines them, and its
``__init__`` sets every attribute declared here. The sections call each other through
``self`` (recovery places workers and lays out the job again).
"""

from __future__ import annotations

import enum
import queue
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strategies import StrategySpec

from .config import JobConfig
from .errors import ClusterError, ElasticError, InfrastructureError, WorkerError
from .events import Event, RunLog
from .view import View

__all__ = ["ControllerBase", "ControllerState", "WorkerRec"]


class ControllerState(enum.Enum):
    STARTING = "starting"
    PLACING = "placing"
    FORMING = "forming"
    RUNNING = "running"
    SWITCHING = "switching"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.FAILED)


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


class ControllerBase:
    """The state every section of the controller shares (set by ``Controller.__init__``)."""

    cfg: JobConfig
    view: View
    state: ControllerState
    requests: queue.Queue[Any]
    events: list[Event]
    history: list[dict[str, Any]]
    workers: list[WorkerRec]
    generation: int
    spec: StrategySpec | None
    step: int
    failures: int
    on_step: Callable[[dict[str, Any]], Any] | None
    _started_ray: bool
    _next_worker_id: int
    _log: RunLog | None
    _probe_model: Any
    _use_gpu: bool
    _control: Any
    _free_slots: list[tuple[Any, int]]  # reserved bundles without a worker
    _warming: list[tuple[WorkerRec, Any]]  # warm spares starting: (worker, ref of its info)
    _speed: dict[int, float]  # worker_id -> measured samples/s
    _used_speeds: list[float] | None  # the speeds the current shares follow
    _running: list[tuple[WorkerRec, Any]]  # the running segment's (worker, future)
    _store: Any
    _resume: tuple[Any, int] | None  # (store, step) to start from
    _ckpt: dict[str, Any] | None  # the checkpoint in flight
    _start_error: str  # why the last worker that failed to start failed
    _target_world: int

    def _emit(self, kind: str, message: str, data: dict[str, Any] | None = None,
              step: int | None = None) -> None:
        raise NotImplementedError

    if TYPE_CHECKING:  # what the sections call across modules (defined in the section named)
        # controller.py
        def _drain(self) -> None: ...
        def _record_step(self, step: int, m: dict[str, Any] | None,
                         spec: StrategySpec | None = None,
                         generation: int | None = None) -> None: ...
        # _ctl_placement.py
        def _form_group(self) -> None: ...
        def _try_place(self, n: int, timeout_s: float) -> None: ...
        def _warm_up(self) -> None: ...
        def _take_warm(self, n: int) -> list[WorkerRec]: ...
        def _room_to_grow(self) -> bool: ...
        # _ctl_layout.py
        def _fit_spec(self, name: str, world: int) -> StrategySpec: ...
        # _ctl_checkpoints.py
        def _checkpoint_restore(self, spec: StrategySpec) -> tuple[str, int, str] | None: ...
        # _ctl_recovery.py
        def _target_strategy(self) -> str: ...
        def _restore(self, spec: StrategySpec, progress: list[dict[str, Any]],
                     held: list[dict[str, Any]]) -> tuple[str, int, str]: ...


def read_detail(outs: list[dict[str, Any]]) -> str:
    """What each worker read of a checkpoint: only its new shard's part of the state."""
    if not outs:
        return ""
    mb = [o["bytes"] / 1e6 for o in outs]
    total = outs[0]["total_bytes"] / 1e6
    return f" (each worker read {min(mb):.1f}-{max(mb):.1f} of {total:.1f} MB)"


def spec_dict(spec: StrategySpec) -> dict[str, Any]:
    return spec.to_dict()


def pg_ready(pg: Any) -> bool:
    """Whether every bundle of ``pg`` is reserved now (no task is started to find out:
    ``pg.ready()`` makes a new task each call, which a zero timeout never sees finish)."""
    import ray

    try:
        return ray.util.placement_group_table(pg).get("state") == "CREATED"
    except Exception:
        return False


def unwrap(e: BaseException) -> BaseException:
    """Turn Ray's wrapper exceptions into ours: user errors stay WorkerError, the rest are
    InfrastructureError."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(e, RayTaskError):
        cause = e.cause if hasattr(e, "cause") else None
        if isinstance(cause, (WorkerError, InfrastructureError, ElasticError)):
            return cause
        return InfrastructureError(str(e))
    if isinstance(e, RayActorError):
        return InfrastructureError(f"a worker died: {e}")
    return e


def check_reachable(addr: str) -> None:
    host, _, port = addr.replace("ray://", "").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            pass
    except (OSError, ValueError) as e:
        raise ClusterError(
            f"cannot reach the Ray cluster at {addr} ({e}). Fix: start one with "
            "`ray start --head`, correct ray_address / RAY_ADDRESS, or unset it to run locally."
        ) from None
