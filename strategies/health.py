"""Whether this process's collectives failed since its group was formed.

torchft's idea: a collective's error is recorded as state, so that whoever handles the
exception that surfaces later (DDP's reducer re-raises a gloo failure from the autograd
engine, where nothing tells it from a user's error) can tell that the group failed. Layouts
record what they see (``record``); the worker resets it when it forms a group and reads it
when a call fails (``elastic.failures.worker_error``). Process-wide; thread-safe enough for
one training thread and one control thread (a list append and a read).
"""

from __future__ import annotations

__all__ = ["record", "failed", "reset"]

_FAILED: list[str] = []


def record(what: str) -> None:
    """A collective of the current group failed: say which, in a few words."""
    _FAILED.append(what)


def failed() -> str | None:
    """The first failure recorded since the last ``reset``, or None."""
    return _FAILED[0] if _FAILED else None


def reset() -> None:
    """A new group was formed: nothing has failed in it yet."""
    _FAILED.clear()
