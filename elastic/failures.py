"""Failures have one home: what went wrong, as a kind, from typed exceptions.

Two boundaries turn raw exceptions into elastic's typed errors (``elastic.errors``), and
nothing downstream looks at message text:

* the worker's (``worker_error``): an exception that left a worker call is a ``GroupError``
  when the process group failed (torch's ``DistError``, an exception raised inside
  ``torch.distributed``'s or DDP's own code, or a failure the layout's collectives recorded in
  ``strategies.health``), else a ``WorkerError`` carrying the user's traceback;
* the worker group's (``elastic.control.worker_group``): Ray's errors become
  ``WorkerLostError`` (process or node lost).

``classify`` maps a typed error to a ``FailureKind``, and ``root_cause`` picks, among what the
ranks of one incident reported, the failure that explains the rest. The policies
(``clusters.policy``) decide what to do with it.
"""

from __future__ import annotations

import enum
import socket
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from strategies.errors import StrategyError

from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointOwnerError,
    ClusterError,
    ConfigError,
    ElasticError,
    GroupError,
    HangError,
    InfrastructureError,
    NonFiniteError,
    StorageError,
    SwitchError,
    WorkerError,
    WorkerLostError,
)

__all__ = ["FailureKind", "Failure", "classify", "first_cause", "root_cause", "worker_error"]


class FailureKind(str, enum.Enum):
    """What went wrong. ``recoverable`` kinds are survived within the failure budget."""

    NODE_LOST = "node_lost"  # a worker's node is gone
    PROCESS_LOST = "process_lost"  # a worker's process died; its node lives
    HANG = "hang"  # a rank stayed inside its step past the group timeout
    GROUP = "group"  # a collective failed on this rank: usually a peer's failure seen here
    USER_CODE = "user_code"  # the job's code raised
    NONFINITE = "nonfinite"  # a loss or gradient norm was NaN or inf
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    STORAGE = "storage"  # checkpoint storage failed
    CLUSTER = "cluster"  # Ray cannot host the job
    CONFIG = "config"
    SWITCH = "switch"  # a layout change was refused; the job keeps its layout
    INTERNAL = "internal"  # anything else: a bug in elastic or its libraries

    @property
    def recoverable(self) -> bool:
        """Whether a job survives it in place (new group, state from peers or a checkpoint)."""
        return self in _RECOVERABLE


_RECOVERABLE = frozenset({FailureKind.NODE_LOST, FailureKind.PROCESS_LOST, FailureKind.HANG,
                          FailureKind.GROUP})


@dataclass(frozen=True)
class Failure:
    """One failure: its kind, a one-line message, and where it happened when known."""

    kind: FailureKind
    message: str
    rank: int | None = None
    step: int | None = None
    error: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def recoverable(self) -> bool:
        return self.kind.recoverable


def classify(exc: BaseException, rank: int | None = None) -> Failure:
    """The failure a typed error stands for (by class only). An exception that is not one of
    elastic's own is ``INTERNAL``: the boundaries above turn every expected one into ours."""
    kind = _kind_of(exc)
    first = str(exc).strip().splitlines()
    msg = first[0][:500] if first else type(exc).__name__
    r = getattr(exc, "rank", None)
    return Failure(kind, msg, rank=r if isinstance(r, int) else rank,
                   step=getattr(exc, "step", None), error=exc)


def _kind_of(exc: BaseException) -> FailureKind:
    if isinstance(exc, WorkerLostError):
        return FailureKind.NODE_LOST if exc.node_lost else FailureKind.PROCESS_LOST
    table: list[tuple[type[BaseException], FailureKind]] = [
        (HangError, FailureKind.HANG),
        (GroupError, FailureKind.GROUP),
        (InfrastructureError, FailureKind.GROUP),
        (WorkerError, FailureKind.USER_CODE),
        (NonFiniteError, FailureKind.NONFINITE),
        (CheckpointCorruptError, FailureKind.CORRUPT_CHECKPOINT),
        (CheckpointOwnerError, FailureKind.CONFIG),
        (StorageError, FailureKind.STORAGE),
        (CheckpointError, FailureKind.STORAGE),
        (ClusterError, FailureKind.CLUSTER),
        (ConfigError, FailureKind.CONFIG),
        (SwitchError, FailureKind.SWITCH),
    ]
    for cls, kind in table:
        if isinstance(exc, cls):
            return kind
    return FailureKind.INTERNAL


# which failure explains the others of one incident (lower first): a lost worker or a hang
# makes its peers' collectives fail, so their GROUP errors are consequences; a user error on
# one rank makes the others time out or lose their connection to it
_PRECEDENCE = [FailureKind.NODE_LOST, FailureKind.PROCESS_LOST, FailureKind.HANG,
               FailureKind.USER_CODE, FailureKind.NONFINITE, FailureKind.CORRUPT_CHECKPOINT,
               FailureKind.STORAGE, FailureKind.CONFIG, FailureKind.CLUSTER,
               FailureKind.INTERNAL, FailureKind.SWITCH, FailureKind.GROUP]


def root_cause(failures: Iterable[Failure]) -> Failure:
    """Of the failures the ranks reported for one incident, the one that explains the rest
    (ties: one whose error names the rank that saw it, then the lowest rank). ``ValueError``
    for none."""
    fs = list(failures)
    if not fs:
        raise ValueError("root_cause needs at least one failure")
    return min(fs, key=lambda f: (_PRECEDENCE.index(f.kind),
                                  getattr(f.error, "rank", None) is None,
                                  f.rank if f.rank is not None else 1 << 30))


def first_cause(errors: Sequence[BaseException]) -> BaseException:
    """Of the errors the ranks raised in one call (rank order), the first that is not an echo
    of another rank's (``secondary``, e.g. ``PeerReadError``), else the first."""
    return next((e for e in errors if not getattr(e, "secondary", False)), errors[0])


# --------------------------------------------------------------------------- worker boundary

# modules whose own code runs the process group's collectives: an exception raised there
# (the innermost frame of its traceback) is the group failing, whatever its message says
_GROUP_MODULES = ("torch.distributed", "torch.nn.parallel.distributed")


# torch's op dispatch: an error an op raises surfaces in its frames, whatever called the op
_DISPATCH_MODULES = ("torch._ops", "torch._library")


def _raised_in_group_code(tb: TracebackType | None) -> bool:
    """Whether the innermost frame, past torch's op dispatch, is torch.distributed's or
    DDP's. Past the dispatch: a functional collective's failure (a DTensor's
    ``full_tensor()`` as zero3 gathers the final state; gloo's "Connection reset by peer")
    is raised in ``torch._ops`` and ``torch._library``, called from
    ``torch.distributed._functional_collectives``
    (was: read as the user's code, a lost worker then failed a finished job); a user's own
    ``torch.ops`` call stays the user's."""
    mods = []
    while tb is not None:
        mods.append(str(tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    while mods and any(mods[-1] == m or mods[-1].startswith(m + ".")
                       for m in _DISPATCH_MODULES):
        mods.pop()
    if not mods:
        return False
    return any(mods[-1] == m or mods[-1].startswith(m + ".") for m in _GROUP_MODULES)


def worker_error(exc: BaseException, rank: int, group_failed: str | None = None
                 ) -> ElasticError:
    """At the worker's boundary: the typed error for ``exc``, raised by a worker call on
    ``rank``. elastic's own errors pass through. A ``GroupError`` when the group failed:
    torch's ``DistError`` (NCCL, the store, timeouts), ``ConnectionError``/``TimeoutError``,
    an exception raised inside torch.distributed's or DDP's own code, or ``group_failed``
    (what the layout's collectives recorded, ``strategies.health.failed()``: DDP's reducer
    raises a gloo failure from the autograd engine, where its frames cannot tell it from a
    user's). A layout's refusal that a setting mends (``StrategyError.setting``) is a
    ``ConfigError`` naming it. Anything else is user code: ``WorkerError`` with the
    traceback."""
    if isinstance(exc, ElasticError):
        return exc
    setting = getattr(exc, "setting", None)
    if isinstance(exc, StrategyError) and setting and group_failed is None:
        problem, _, fix = str(exc).partition(" Fix: ")  # a layout's refusal a setting mends
        return ConfigError(setting, problem, fix)
    dist_error: type[BaseException] | None = None
    try:
        import torch.distributed as dist

        dist_error = getattr(dist, "DistError", None)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    is_group = (
        (dist_error is not None and isinstance(exc, dist_error))
        or isinstance(exc, (ConnectionError, TimeoutError))
        or _raised_in_group_code(exc.__traceback__)
        or group_failed is not None
    )
    if is_group:
        why = f"; the group had recorded: {group_failed}" if group_failed else ""
        err = GroupError(f"rank {rank}: the process group failed "
                         f"({type(exc).__name__}: {_first_line(exc)}){why}")
        err.transport = not (type(exc) in (RuntimeError, ValueError, TypeError)
                             and group_failed is None)
        return err
    return WorkerError(rank, socket.gethostname(), f"{type(exc).__name__}: {exc}",
                       "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
