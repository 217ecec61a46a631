"""One error hierarchy for elastic. Every error is picklable across Ray actors and names its fix.

The classes say what went wrong, not where it was noticed: ``elastic.failures`` turns them
into failure kinds for the policies, and a user sees the same class (a corrupt checkpoint is a
``CheckpointCorruptError``, never "user code failed").
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ElasticError",
    "ConfigError",
    "ClusterError",
    "WorkerError",
    "InfrastructureError",
    "GroupError",
    "WorkerLostError",
    "HangError",
    "CheckpointError",
    "CheckpointCorruptError",
    "PeerReadError",
    "StorageError",
    "CheckpointOwnerError",
    "NonFiniteError",
    "SwitchError",
    "StateMoveError",
    "ActorGoneError",
    "JobNotFoundError",
    "InterruptedJobError",
]


class ElasticError(Exception):
    """Root of every error elastic raises on purpose."""


class ConfigError(ElasticError, ValueError):
    """A job, sweep or cluster configuration is wrong.

    ``field`` names the offending setting, ``fix`` says what to do instead.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:  # (a problem that does not end a sentence gets its full stop)
            msg += f"{'' if problem.rstrip().endswith(('.', '?', '!')) else '.'} Fix: {fix}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the three fields through pickling
        return (type(self), (self.field, self.problem, self.fix))


class ClusterError(ElasticError):
    """The Ray cluster cannot be reached, or cannot host the job."""


class WorkerError(ElasticError):
    """User code raised on a worker; carries the worker's rank, the step it was in (None:
    outside a step), ``during``: the part of that step's iteration when not the step itself
    (``"the evaluation after it"``), ``part``: the rank's part of the step, in words ("1
    sample"), and its traceback."""

    def __init__(self, rank: int, node: str, message: str, traceback_text: str,
                 step: int | None = None, during: str | None = None,
                 part: str | None = None) -> None:
        self.rank = rank
        self.node = node
        self.message = message
        self.traceback_text = traceback_text
        self.step = step
        self.during = during
        self.part = part
        at = f" at step {step}" if step is not None else ""
        at += f", in {during}" if step is not None and during else ""
        at += f" (its part: {part})" if step is not None and part else ""
        super().__init__(
            f"user code failed on worker rank {rank} (node {node}){at}: {message}\n"
            f"--- worker traceback (rank {rank}) ---\n{traceback_text}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.node, self.message, self.traceback_text,
                             self.step, self.during, self.part))


class InfrastructureError(ElasticError):
    """A worker, node or collective failed for reasons outside user code (recoverable
    within the job's failure budget)."""


class GroupError(InfrastructureError):
    """A collective of the process group failed on this rank: a peer was lost, closed its
    connection or timed out. Usually the consequence of another rank's failure.
    ``transport``: False when torch.distributed's own code refused the call itself (a plain
    exception raised there, not a network, store or timeout error, nothing recorded by the
    layout's collectives): what a layout or the job handed it, which a retry repeats."""

    transport: bool = True


class WorkerLostError(InfrastructureError):
    """A worker's process is gone (``node_lost``: with its node)."""

    def __init__(self, message: str, rank: int | None = None, node_lost: bool = False) -> None:
        self.rank = rank
        self.node_lost = node_lost
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.rank, self.node_lost))


class HangError(InfrastructureError):
    """A rank stayed inside its step longer than the group timeout after its peers failed."""


class CheckpointError(ElasticError):
    """A checkpoint cannot be written, found, verified or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint's bytes do not match its manifest (checksum, size, index)."""


class PeerReadError(CheckpointCorruptError):
    """This rank read its part of a checkpoint, but another rank could not read its own: an
    echo of that rank's error, which is the one to report."""

    secondary = True


class StorageError(CheckpointError):
    """The checkpoint storage failed (unreachable, permission, I/O)."""


class CheckpointOwnerError(CheckpointError):
    """Another job owns the checkpoint URI, or wrote the checkpoint: writing there, or resuming
    from it as this job's own, is refused before anything is written. ``owner`` names that
    job; the message names the fix (an own ``checkpoint_uri``, or an explicit fork)."""

    def __init__(self, message: str, owner: str | None = None) -> None:
        self.owner = owner
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.owner))


class NonFiniteError(ElasticError):
    """A step's loss or gradient norm was not finite (NaN or inf)."""

    def __init__(self, message: str, step: int | None = None, rank: int | None = None,
                 rollback: bool = False) -> None:
        self.step = step
        self.rank = rank
        self.rollback = rollback  # the job's on_nonfinite asks to restore the last checkpoint
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.step, self.rank, self.rollback))


class SwitchError(ElasticError):
    """A strategy switch was refused or failed; the job keeps its previous layout."""


class StateMoveError(ElasticError):
    """Moving the state from host memory (the pieces a draining node handed over, or the
    copies buddies keep) failed its check, or found a copy whose checksum does not match;
    nothing was loaded, and the job restores from storage instead."""


class ActorGoneError(ElasticError):
    """An actor elastic called (a scheduler, a job's mailbox) is gone: its process died, or
    it was stopped."""


class JobNotFoundError(ElasticError):
    """No running elastic job has that name."""


class InterruptedJobError(ElasticError):
    """The job was stopped by a signal (SIGINT, SIGTERM) at a step boundary; ``result`` is
    what it had trained (the ``FitResult``), ``exit_code`` the shell's 128 + signal."""

    def __init__(self, signum: int, result: Any = None) -> None:
        import signal

        self.signum = signum
        self.result = result
        self.exit_code = 128 + int(signum)
        name = signal.Signals(signum).name
        done = len(result.history) if result is not None else 0
        super().__init__(f"interrupted by {name} after {done} steps; the job stopped at a step "
                         "boundary" + (f" (run directory {result.run_dir})" if result else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum, self.result))
