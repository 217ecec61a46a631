"""elastic: a Ray-based elastic training orchestrator.

``elastic.fit(...)`` trains a job on Ray actors (one per device) and returns a ``FitResult``;
``elastic.submit(...)`` returns a handle to switch strategies or stop while it runs;
``elastic.WorkerPool(...)`` keeps worker processes warm between jobs (``pool=``).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import JobHandle, fit, submit
    from .config import JobConfig
    from .control import FitResult
    from .control.pool import WorkerPool
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

# Imported on first use (PEP 562), so that `elastic status` and the other CLI commands that
# train nothing do not import torch (~2 s).
_WHERE = {"JobHandle": "api", "fit": "api", "submit": "api", "JobConfig": "config",
          "FitResult": "control", "Event": "events", "WorkerPool": "control.pool",
          **{n: "errors" for n in ("ElasticError", "ConfigError", "ClusterError", "WorkerError",
                                   "InfrastructureError", "CheckpointError", "SwitchError")}}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")


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


__version__ = "0.1.0"
