"""The job's checkpoint store, built from the location its config parsed once.

Which rank writes which pieces, the writer and restores are the worker's
(``elastic/worker/checkpointing.py``).
"""

from __future__ import annotations

from .checkpoint import CheckpointStore
from .config import JobConfig, WorkerConfig

__all__ = ["job_store"]


def job_store(cfg: JobConfig | WorkerConfig) -> CheckpointStore:
    """The job's checkpoint store (``checkpoint_uri`` or ``<run dir>/checkpoints``), over the
    location the config parsed once: building a store here parses nothing."""
    location = cfg.checkpoint_location
    if location is None:
        raise ValueError("this worker's job writes no checkpoints; there is no store")
    return CheckpointStore(location)
