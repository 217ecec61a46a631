"""Errors raised by ``clusters``. Picklable (they cross Ray actors) and each names its fix.

``clusters`` must not import ``elastic``, so it has its own small hierarchy rooted at
``ClustersError``; ``elastic`` may wrap these in its ``ElasticError`` tree. Every class is also a
``ValueError`` where the cause is bad input, so callers that only know builtins still catch it.
"""

from __future__ import annotations

__all__ = [
    "ClustersError",
    "ClusterFileError",
    "InventoryError",
    "ProfileError",
    "PlanError",
    "BalanceError",
    "TraceError",
    "SimulationError",
]


class ClustersError(Exception):
    """Root of every error ``clusters`` raises on purpose."""


class ClusterFileError(ClustersError, ValueError):
    """A cluster file (or dict) is malformed.

    ``field`` is a path such as ``pools[1].device``; ``problem`` says what is wrong and ``fix``
    what to write instead. ``source`` names the file when there is one.
    """

    def __init__(self, field: str, problem: str, fix: str = "", source: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        self.source = source
        where = f"{source}: " if source else ""
        msg = f"{where}{field}: {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)

    def __reduce__(self):  # keep every field through pickling
        return (type(self), (self.field, self.problem, self.fix, self.source))


class InventoryError(ClustersError, ValueError):
    """``ray.nodes()`` output cannot be mapped onto the catalog (e.g. an unknown accelerator)."""


class ProfileError(ClustersError, ValueError):
    """A model profile is inconsistent (lengths differ, negative sizes, nothing to time with)."""


class PlanError(ClustersError, ValueError):
    """A plan is invalid, or no plan fits the cluster; the message lists the reasons."""


class BalanceError(ClustersError, ValueError):
    """Shares or stage splits cannot satisfy the constraints (too few samples, caps too low)."""


class TraceError(ClustersError, ValueError):
    """A failure trace (a file or a list of events) is malformed.

    ``where`` is ``file:line`` (or ``events[i]``), ``problem`` what is wrong and ``fix`` what
    to write instead.
    """

    def __init__(self, where: str, problem: str, fix: str = "") -> None:
        self.where = where
        self.problem = problem
        self.fix = fix
        super().__init__(f"{where}: {problem}" + (f" Fix: {fix}" if fix else ""))

    def __reduce__(self):  # keep every field through pickling
        return (type(self), (self.where, self.problem, self.fix))


class SimulationError(ClustersError, ValueError):
    """A simulation cannot run as configured (a bad ``SimConfig`` value, a policy without a
    name); the message names the setting and the fix."""
