"""The SDK's ``JobHandle`` over a controller of this process, without Ray."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from elastic.api import JobHandle


class _Silent:
    """A controller whose step boundary never comes: requests are taken, never answered."""

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.end = threading.Event()

    def run(self) -> None:
        self.end.wait(30)

    def post(self, req: Any) -> None:
        self.posted.append(req)


def test_a_request_not_answered_in_time_says_so_and_that_it_may_still_happen():
    """``job.scale(3, timeout=...)`` while the job never reaches a boundary: a
    ``TimeoutError`` naming the request and that it stays posted. Was: a bare
    ``queue.Empty`` with no message (found by review, session 44)."""
    ctl = _Silent()
    job = JobHandle(ctl)  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeoutError, match=r"scale 3 not answered within 0.05 s .*may "
                                               r"still be carried out"):
            job.scale(3, timeout=0.05)
        with pytest.raises(TimeoutError, match=r"^stop not answered"):
            job.stop(timeout=0.05)
        assert [r.kind for r in ctl.posted] == ["scale", "stop"]
    finally:
        ctl.end.set()
