"""One error hierarchy for elastic. Every error is picklable across Ray actors and names its fix."""

from __future__ import annotations

__all__ = [
    "ElasticError",
    "ConfigError",
    "ClusterError",
    "WorkerError",
    "InfrastructureError",
    "CheckpointError",
    "SwitchError",
    "JobNotFoundError",
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
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)

    def __reduce__(self):  # keep the three fields through pickling
        return (type(self), (self.field, self.problem, self.fix))


class ClusterError(ElasticError):
    """The Ray cluster cannot be reached, or cannot host the job."""


class WorkerError(ElasticError):
    """User code raised on a worker; carries the worker's rank and its traceback."""

    def __init__(self, rank: int, node: str, message: str, traceback_text: str) -> None:
        self.rank = rank
        self.node = node
        self.message = message
        self.traceback_text = traceback_text
        super().__init__(
            f"user code failed on worker rank {rank} (node {node}): {message}\n"
            f"--- worker traceback (rank {rank}) ---\n{traceback_text}"
        )

    def __reduce__(self):
        return (type(self), (self.rank, self.node, self.message, self.traceback_text))


class InfrastructureError(ElasticError):
    """A worker, node or collective failed for reasons outside user code."""


class CheckpointError(ElasticError):
    """A checkpoint cannot be written, found, verified or loaded."""


class SwitchError(ElasticError):
    """A strategy switch was refused or failed; the job keeps its previous layout."""


class JobNotFoundError(ElasticError):
    """No running elastic job has that name."""
