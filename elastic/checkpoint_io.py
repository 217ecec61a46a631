"""The job's checkpoint store: where a job's checkpoints live.

Which rank writes which pieces, the writer and restores are the worker's
(``elastic.worker.checkpointing``); committing, retention and resume are the controller's.
"""

from __future__ import annotations

import os

from .checkpoint import CheckpointStore
from .config import JobConfig

__all__ = ["job_store"]


def job_store(cfg: JobConfig) -> CheckpointStore:
    """The job's checkpoint store: ``checkpoint_uri`` or ``<run dir>/checkpoints``."""
    uri = cfg.checkpoint_uri or os.path.join(cfg.run_path, "checkpoints")
    return CheckpointStore(uri, dict(cfg.checkpoint_options))
