"""Where a job's events go: the list its result carries, the run's log once the run
directory exists (what was said before is written first), and the view (every event but
the state transitions, which are for the log); messages and data are redacted of secrets
before they go anywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..events import Event, RunLog

__all__ = ["EventSink"]


class EventSink:
    """``emit`` is what every part of the controller is handed; ``step_of`` says the step an
    event is at when the caller names none."""

    def __init__(self, cfg: Any, view: Any, step_of: Callable[[], int]) -> None:
        self.cfg = cfg
        self.view = view
        self._step_of = step_of
        self.events: list[Event] = []
        self.log: RunLog | None = None
        bind = getattr(view, "bind", None)  # a view that says things of its own (trackers)
        if bind is not None:
            bind(self.emit)

    def open(self, log: RunLog) -> None:
        """Write to ``log`` from now on, after what was said before it existed."""
        self.log = log
        for ev in self.events:
            log.event(ev)

    def emit(self, kind: str, message: str, data: dict[str, Any] | None = None,
             step: int | None = None) -> Event:
        ev = Event(kind, self.cfg.redact(message), step=self._step_of() if step is None else step,
                   data=self.cfg.redact_value(data or {}))
        self.events.append(ev)
        if self.log is not None:
            self.log.event(ev)
        if kind != "state":
            self.view.event(ev)
        return ev

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
