"""The worker's error boundary: what leaves a worker call is one of elastic's typed errors.

``elastic.failures.worker_error`` decides the type from where the exception was raised and
from what the layout's collectives recorded (``strategies.health``), never from its text.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from strategies import health

from ..errors import ElasticError
from ..failures import worker_error

__all__ = ["guarded"]

T = TypeVar("T")


def guarded(rank: int, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` as rank ``rank``. elastic's own errors (``SwitchError``, a
    ``CheckpointError``, ...) pass through unchanged; any other exception becomes
    ``worker_error(exc, rank, strategies.health.failed())``: a ``GroupError`` when the group
    failed, else a ``WorkerError`` carrying the traceback.

    The failed call's frames are cleared and the typed error is raised outside the handler
    (no ``__context__``): a frame of a failed collective holds its gloo work and with it the
    group's sockets, so peers blocked on this rank would otherwise wait out the group
    timeout even after ``leave()`` (node-loss recovery depends on it)."""
    try:
        return fn(*args)
    except ElasticError:
        raise
    except Exception as e:
        err = worker_error(e, rank, health.failed())
        traceback.clear_frames(e.__traceback__)
    raise err
