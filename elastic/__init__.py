"""elastic: a Ray-based elastic training orchestrator.

``elastic.fit(...)`` trains a job on Ray actors (one per device) and returns a ``FitResult``;
``elastic.submit(...)`` returns a handle to switch strategies or stop while it runs.
"""

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
]

__version__ = "0.1.0"
