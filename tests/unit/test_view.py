"""The live views rendered to strings: RichView on a recording console with an injected clock,
PlainView on a StringIO. No Ray."""

from __future__ import annotations

import io

import pytest

from elastic.events import Event
from elastic.view import PlainView, RichView, View, make_view

pytest.importorskip("rich")

WORKERS = [
    {"rank": 0, "hostname": "host-a", "node_id": "abcdef123456", "device_name": "cpu", "share": 6,
     "samples_per_s": 1234.5, "memory": {"params": 1.0e6, "optim": 2.0e6}},
    {"rank": 1, "hostname": "host-b", "node_id": "99abcdef0000",
     "device_name": "T4 (emulated on cpu, x3)", "emulated": True, "share": 2},
    {"rank": 2, "hostname": "host[c]", "node_id": "77abcdef0000", "device_name": "cpu",
     "emulated": True, "share": 4},
]
GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=120, force_terminal=False, record=True)


def _feed(view: View, clock: Clock) -> None:
    view.start("view-job", 10)
    view.workers(WORKERS)
    view.event(Event("placed", "3 workers on 3 node(s)", step=0, time=1000.4))
    for s in range(5):
        view.step({"step": s, "loss": 1.0 / (s + 1) + 0.0034, "samples_per_s": 2345.0 + s,
                   "world_size": 3, "strategy": "dp", "step_time": 0.01, "time": 1001.0 + s})
    view.event(Event("switch", "dp -> zero1 (requested) in 0.12s", step=5, time=1002.5))
    view.step({"step": 5, "loss": 0.1234, "samples_per_s": 3456.0, "world_size": 3,
               "strategy": "zero1", "step_time": 0.01, "time": 1003.0})
    clock.t = 1042.0
    # a failure message as gloo writes it: must show literally, not be taken for rich markup
    view.event(Event("failure", f"1 worker(s) lost (ranks [1]): {GLOO}", step=6, time=1003.7))


@pytest.mark.parametrize("live", [False, True])
def test_rich_view_shows_progress_workers_devices_and_events(live):
    console, clock = _console(), Clock(1000.0)
    view = RichView(console=console, clock=clock, live=live)
    _feed(view, clock)
    if live:
        view.close()  # a live display on a non-terminal prints its last frame once, at the end
    else:
        console.print(view.render())
    text = console.export_text()
    lines = text.splitlines()
    head = next(x for x in lines if "view-job" in x)
    for part in ("step 6/10", "loss 0.1234", "3,456 samples/s", "strategy zero1", "world 3",
                 "42s"):  # elapsed by the injected clock: 1042 - 1000
        assert part in head, (part, head)
    bar = lines[lines.index(head) + 1]
    assert bar.count("━") == 36  # 6 of 10 steps on a 60-cell bar
    rows = {int(x.strip("│ ").split("│")[0]): x for x in lines
            if x.strip("│ ")[:1].isdigit() and x.count("│") >= 6}
    assert sorted(rows) == [0, 1, 2]
    assert "host-a abcdef" in rows[0] and " cpu " in rows[0] and "(emulated" not in rows[0]
    assert "1,234" in rows[0] and "p:1.0M o:2.0M" in rows[0] and " 6 " in rows[0]
    # an emulated device is marked once: by its own name, or by the view's "(emulated)"
    assert "T4 (emulated on cpu, x3)" in rows[1] and rows[1].count("emulated") == 1
    assert "host[c] 77abcd" in rows[2] and "cpu (emulated)" in rows[2]
    # the event timeline: time since start by the event's clock, kind@step, the message
    timeline = [x for x in lines if "@" in x and "s │" in x]
    assert len(timeline) == 3
    assert "0.4s │ placed@0 3 workers on 3 node(s)" in timeline[0]
    assert "2.5s │ switch@5 dp -> zero1 (requested) in 0.12s" in timeline[1]
    assert "3.7s │ failure@6 1 worker(s) lost (ranks [1]): [/pytorch/third_party/gloo" in timeline[2]


def test_rich_view_keeps_the_last_eight_events_and_renders_before_any_step():
    console, clock = _console(), Clock(50.0)
    view = RichView(console=console, clock=clock, live=False)
    view.start("empty-job", 3)
    console.print(view.render())  # nothing yet: no step, no worker
    text = console.export_text(clear=True)
    assert "step 0/3" in text and "loss nan" in text and "strategy -" in text
    for i in range(12):
        view.event(Event("joined", f"event number {i}", step=i, time=50.0 + i))
    console.print(view.render())
    text = console.export_text()
    for i in range(12):
        assert (f"joined@{i} event number {i}" in text) == (i >= 4), i


def test_plain_view_lines():
    out = io.StringIO()
    view = PlainView(out=out, log_every=2)
    _feed(view, Clock(0.0))
    view.workers(WORKERS)  # unchanged workers are not printed again
    view.step({"step": 9, "loss": float("nan"), "samples_per_s": 0.0, "world_size": 2,
               "strategy": "zero1"})
    lines = out.getvalue().splitlines()
    assert lines[0] == "[elastic] job view-job: 10 steps"
    assert lines[1:4] == [
        "[elastic] worker rank 0 on host-a node abcdef12 device cpu",
        "[elastic] worker rank 1 on host-b node 99abcdef device T4 (emulated on cpu, x3)",
        "[elastic] worker rank 2 on host[c] node 77abcdef device cpu (emulated)",
    ]
    assert lines[4] == "[elastic] placed at step 0: 3 workers on 3 node(s)"
    steps = [x for x in lines if x.startswith("[elastic] step ")]
    assert steps == [  # every 2nd step, and the last one
        "[elastic] step 2/10 loss 0.5034 2346 samples/s world 3 strategy dp",
        "[elastic] step 4/10 loss 0.2534 2348 samples/s world 3 strategy dp",
        "[elastic] step 6/10 loss 0.1234 3456 samples/s world 3 strategy zero1",
        "[elastic] step 10/10 loss nan 0 samples/s world 2 strategy zero1",
    ]
    assert "[elastic] switch at step 5: dp -> zero1 (requested) in 0.12s" in lines
    assert f"[elastic] failure at step 6: 1 worker(s) lost (ranks [1]): {GLOO}" in lines
    assert len(lines) == 1 + 3 + 1 + 4 + 2


def test_plain_view_says_a_failure_once_the_error_itself_is_raised():
    """The error that ended a job is raised (``elastic run`` prints it as its one
    ``elastic: error:`` line); the plain view says where, not the whole text again (two users
    found each error printed twice)."""
    from elastic.events import Event

    out = io.StringIO()
    PlainView(out=out).event(Event("failed", "strategy: pipeline cannot run here: ...", step=0))
    # a check before the first step is no step's failure (was: "failed at step 0")
    assert out.getvalue() == ("[elastic] failed before any step ran: its error is raised to "
                              "the caller\n")
    out = io.StringIO()  # user code that failed in the first step
    PlainView(out=out).event(Event("failed", "user code failed ...", step=0,
                                   data={"in_step": True}))
    assert out.getvalue() == "[elastic] failed at step 0: its error is raised to the caller\n"
    out = io.StringIO()
    view = PlainView(out=out, log_every=10)
    view.step({"step": 4, "loss": 1.0, "samples_per_s": 1.0, "world_size": 1, "strategy": "dp"})
    view.event(Event("failed", "checkpoint storage ...", step=5, data={"in_step": True}))
    assert out.getvalue() == "[elastic] failed at step 5: its error is raised to the caller\n"


def test_make_view_modes():
    assert type(make_view("none")) is View
    assert isinstance(make_view("plain", log_every=5), PlainView)
    assert make_view("plain", log_every=5).log_every == 5
    assert isinstance(make_view("rich"), RichView)
    assert isinstance(make_view("auto"), PlainView)  # pytest captures stdout: not a terminal
