"""Requests to a running job (switch, scale, stop, ...), validated where they enter.

A request comes from the SDK handle (in the driver's process), from the CLI through the job's
mailbox actor, or from the controller itself (a spare joined, the ``on_step`` callback asked
to stop). ``parse`` checks its kind and the type of its value before it is queued, so a
malformed request is refused with the fix and never reaches the controller's loop; what
depends on the job (the size range, the strategy's fit) is checked at the step boundary and
refused there, with the job going on.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

from ..errors import ElasticError

__all__ = ["Request", "RequestError", "parse", "KINDS", "PUBLIC_KINDS"]

PUBLIC_KINDS = ("switch", "scale", "stop", "memory")  # what the SDK, CLI and mailbox may ask
KINDS = PUBLIC_KINDS + ("grow",)  # "grow": the controller's own (a warm spare is up)


class RequestError(ElasticError):
    """A request that cannot be carried out as given; the job goes on unchanged."""


@dataclass
class Request:
    """A request posted to a running controller. ``reply`` (SDK) or ``remote_id`` (mailbox)
    says where the answer goes."""

    kind: str
    value: Any = None
    reason: str = "requested"
    reply: queue.Queue[Any] | None = None
    remote_id: int | None = None


def parse(kind: Any, value: Any = None, reason: str = "requested", *,
          internal: bool = False) -> Request:
    """A validated ``Request``; ``RequestError`` naming the fix otherwise. ``internal``
    admits the controller's own kinds."""
    kinds = KINDS if internal else PUBLIC_KINDS
    if not isinstance(kind, str) or kind not in kinds:
        raise RequestError(f"unknown request {kind!r}. Fix: ask one of {', '.join(PUBLIC_KINDS)}")
    if kind == "scale":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("+").isdigit():
                value = int(value)
            else:
                raise RequestError(f"scale needs a whole number of workers, got {value!r}. "
                                   "Fix: e.g. `elastic scale JOB 4` or job.scale(4)")
        if value < 1:
            raise RequestError(f"scale needs at least 1 worker, got {value}")
    elif kind == "switch":
        if not isinstance(value, str) or not value.strip():
            raise RequestError(f"switch needs a strategy name, got {value!r}. Fix: e.g. "
                               "`elastic switch JOB zero3`")
        value = value.strip()
    elif value is not None:
        raise RequestError(f"{kind} takes no value, got {value!r}")
    return Request(kind, value, str(reason or "requested"))
