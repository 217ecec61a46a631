"""Calls made for other threads from a thread of this Ray session (``Teller``).

A thread that made Ray calls in an earlier Ray session of this process keeps that session's
task ids, and a new local cluster numbers its job as the last one did: a call from such a
thread (the SDK's, after an earlier ``fit`` ran on it) reused an id the job's own thread had
taken, and Ray aborted the process (``fit`` then ``submit`` and two switches; 2026-12-05).
So the job's fire-and-forget calls from any thread but its own go through a thread started
for them in the job's session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["Teller"]


class Teller:
    """Runs ``fn`` at once on the thread that made it (the job's), else on a thread of its
    own, started on first use; after ``close`` calls from other threads are dropped."""

    def __init__(self) -> None:
        self._home = threading.current_thread()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        if threading.current_thread() is self._home:
            fn(*args)
            return
        with self._lock:
            if self._closed:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-tell")
            self._pool.submit(fn, *args)

    def close(self) -> None:
        """End the thread; what it had yet to send no longer matters."""
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
