"""The warm pool's watch: between jobs nobody asks a ``WorkerPool`` anything, so a thread
calls its ``maintain`` every few seconds (idle workers that died, sit on a draining node or
idled too long are retired, and the pool refills; ``clusters.pool_policy`` decides).

The thread holds the pool by a weak reference (a pool dropped without ``close`` is collected
and its watch ends) and ends when ``maintain`` says the pool is closed or out of the Ray
session it was made in. At interpreter exit it is stopped before Ray's own shutdown runs
(``atexit`` runs in reverse order of registration), after the round in progress, since a
Ray call after the shutdown would start a new Ray.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["start_watch"]


class _Maintained(Protocol):
    def maintain(self) -> bool: ...


def start_watch(pool: _Maintained, stop: threading.Event, lock: Any, every_s: float) -> None:
    """Run ``pool.maintain()`` every ``every_s`` until ``stop`` is set, the pool is collected,
    or ``maintain`` returns False; ``lock``: held by a whole round in progress (its Ray calls
    too)."""
    ref = weakref.ref(pool)
    threading.Thread(target=_watch, args=(ref, stop, every_s), daemon=True,
                     name="elastic-pool-watch").start()
    atexit.register(_stop_at_exit, stop, lock)


def _watch(ref: weakref.ref[Any], stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        pool = ref()
        if pool is None:
            return
        try:
            if not pool.maintain():
                return
        except Exception as e:  # noqa: BLE001 - the GCS busy or going: the next round
            log.debug("the pool's watch: %s: %s", type(e).__name__, e)
        del pool


def _stop_at_exit(stop: threading.Event, lock: Any) -> None:
    stop.set()
    if lock.acquire(timeout=5.0):  # the round in progress ends first (bounded: a GCS
        lock.release()             # that is gone must not hold the exit up)
