"""Signals that stop a job: SIGINT (Ctrl-C) and SIGTERM (what ``ray job stop`` sends).

The first asks the job to stop at the next step boundary (after a final checkpoint when the
job takes checkpoints); a second stops it at once. Handlers are installed only in the main
thread (a job run by ``submit`` leaves signals to the program) and only record the signal:
the controller's loop acts on it within a poll, since a handler that took locks or called
Ray could deadlock the thread it interrupted.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupts"]


class Interrupts:
    """The signal a job was asked to stop by (``signum``, None if none)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.acted = False  # the controller has asked the job to stop for it
        self._handler: Any = None  # while installed

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def pending(self) -> bool:
        """A signal came and the controller has not acted on it yet."""
        return self.signum is not None and not self.acted

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """SIGINT and SIGTERM handlers for the duration (main thread only); the program's
        own handlers are put back after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.signum is not None:
                raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
            self.signum = signum

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._handler = handler
        try:
            yield
        finally:
            self._handler = None
            for sig, h in old.items():
                signal.signal(sig, h)

    def reclaim(self) -> None:
        """Put the handlers back after something replaced them: connecting to Ray installs
        Ray's own fatal-signal handler, under which SIGTERM kills the driver outright."""
        if self._handler is not None and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handler)
