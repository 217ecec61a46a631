"""The wait for replacements at a preemption notice below ``min_workers``
(``elastic.control.evacuation.Evacuation``'s hold), over stand-ins for the worker group:
training goes on until the replacements are up or the wait is over, every pending node
counts, and a spare that failed to start is not one that is up. Found by the review of the
change that added it (session 45)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from elastic.control.evacuation import Evacuation
from elastic.control.group import DrainNotice


class _Group:
    def __init__(self) -> None:
        self.workers = [SimpleNamespace(worker_id=i, rank=i, info={"node_id": f"n{i}"})
                        for i in range(3)]
        self.drains: list[DrainNotice] = []
        self.ready = 0
        self.asked: list[int] = []

    def notices(self) -> list[DrainNotice]:
        return list(self.drains)

    def spares_ready(self) -> int:
        return self.ready

    def spares_starting(self) -> int:
        return 0

    def start_spares(self, n: int) -> None:
        self.asked.append(n)


def _evacuation(group: _Group, poll_s: float = 5.0) -> tuple[Evacuation, list[Any]]:
    cfg = SimpleNamespace(watch_drains=True, drain_poll_s=poll_s, min_world=3,
                          min_workers_timeout_s=60.0, peer_copies_every=0,
                          evacuation_margin=2.0, evacuation_slack_s=1.0, global_batch_size=12)
    events: list[Any] = []
    ev = Evacuation(cfg, group, SimpleNamespace(probe_model=None),
                    SimpleNamespace(store=None, last_event=None), None,
                    lambda kind, msg, **kw: events.append((kind, msg)), lambda: 5,
                    lambda n: 3)
    return ev, events


def _notice(node: str, left_s: float) -> DrainNotice:
    return DrainNotice(node, (int(node[1:]),), time.time() + left_s, "preemption", "", time.time())


def test_a_held_notice_waits_between_drain_polls_and_is_due_once_a_spare_is_up():
    """Was: between two drain polls ``watch`` said a notice was due whenever one was pending,
    so the controller stopped at the next boundary and waited for the replacement there,
    training paused (the controller polls every 0.25 s; drains every 1 s)."""
    g = _Group()
    ev, events = _evacuation(g)
    g.drains = [_notice("n2", 60.0)]
    assert ev.watch(now=0.0) is False  # held: training goes on
    assert [k for k, _ in events] == ["preemption_notice", "replacing"] and g.asked == [1]
    assert ev.watch(now=1.0) is False  # between polls: still held
    g.ready = 1
    assert ev.watch(now=2.0) is True  # its replacement is up: the boundary takes it in


def test_every_pending_node_counts_and_the_first_deadline_bounds_the_wait():
    """A second notice while held: both nodes' ranks need replacements, and the wait ends
    by the earlier deadline. Was: the hold kept the first notice's count and deadline."""
    g = _Group()
    ev, _ = _evacuation(g, poll_s=1e-9)
    g.drains = [_notice("n2", 600.0)]
    ev.watch(now=0.0)
    first = ev._until  # noqa: SLF001
    g.drains.append(_notice("n1", 20.0))
    ev.watch(now=1.0)
    assert ev._need == 2  # noqa: SLF001
    assert first is not None and ev._until is not None and ev._until < first - 30  # noqa: SLF001


def test_a_notice_with_no_time_to_wait_is_acted_on_at_once():
    g = _Group()
    ev, events = _evacuation(g)
    g.drains = [_notice("n2", 3.0)]
    assert ev.watch(now=0.0) is True
    assert [k for k, _ in events] == ["preemption_notice"]
    assert "evacuating at the next step boundary" in events[0][1]
