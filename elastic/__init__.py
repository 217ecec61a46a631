"""elastic: a Ray-based elastic training orchestrator.

``elastic.fit(...)`` trains a job on Ray actors (one per device) and returns a ``FitResult``;
``elastic.submit(...)`` returns a handle to switch strategies or stop while it runs;
``elastic.WorkerPool(...)`` keeps worker processes warm between jobs (``pool=``).
"""

from typing import Any

from .api import JobHandle, fit, submit
from .config import JobConfig
from .control import FitResult
from .errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    ElasticError,
    InfrastructureError,
    SwitchError,
    WorkerError,
)
from .events import Event

__all__ = [
    "fit",
    "submit",
    "JobHandle",
    "JobConfig",
    "FitResult",
    "Event",
    "ElasticError",
    "ConfigError",
    "ClusterError",
    "WorkerError",
    "InfrastructureError",
    "CheckpointError",
    "SwitchError",
    "WorkerPool",
]


def __getattr__(name: str) -> Any:
    if name == "WorkerPool":  # loaded when used: it brings the Ray-aware worker group
        from .control.pool import WorkerPool

        return WorkerPool
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")

__version__ = "0.1.0"
