"""The live view of a scheduler's queue (``elastic queue watch``), rendered to a string from
the queue's state alone. No Ray."""

from __future__ import annotations

import io

import pytest

from elastic.queue_view import render_queue, watch

pytest.importorskip("rich")

INFO = {"name": "lab", "policy": "srpt", "workers": 4, "decisions": 17,
        "errors": ["RuntimeError: boom [x]"]}


def _row(job: str, state: str, workers: int = 0, **kw) -> dict:
    row = {"job": job, "state": state, "workers": workers, "step": 0, "max_steps": 100,
           "min_workers": 1, "max_workers": 4, "submitted_s": 0.0, "remaining_s": None,
           "reason": "", "error": None, "resizes": 0, "resizing": False}
    row.update(kw)
    return row


ROWS = [
    _row("done-job", "finished", step=30, max_steps=30, submitted_s=0.0, reason="ended"),
    _row("waits", "queued", submitted_s=5.0, reason="queued: no room (4 of 4 in use)"),
    _row("long", "running", 1, step=412, max_steps=100000, remaining_s=3900.0, submitted_s=1.0,
         resizes=1, reason="shrunk 4->1: made room for short [sweep]"),
    _row("short", "running", 3, step=7, max_steps=30, remaining_s=12.4, submitted_s=2.0,
         resizing=True, reason="#1 by remaining work"),
    _row("bad", "failed", step=3, error="WorkerError: user code failed on rank 0",
         submitted_s=3.0),
]


def _line(lines: list[str], job: str) -> int:
    """The index of ``job``'s row (its first cell)."""
    return next(i for i, ln in enumerate(lines)
                if "│" in ln and ln.split("│")[1].strip() == job)


def _text(renderable, width: int = 160) -> str:
    from rich.console import Console

    c = Console(file=io.StringIO(), width=width, force_terminal=False, record=True)
    c.print(renderable)
    return c.export_text()


def test_every_job_with_state_allocation_steps_time_left_and_why():
    out = _text(render_queue(ROWS, INFO))
    lines = out.splitlines()
    # the header: scheduler, policy, workers in use of its capacity, counts, decisions
    assert "scheduler lab" in out and "policy srpt" in out and "workers 4/4 in use" in out
    assert "2 running, 1 queued" in out and "decisions 17" in out
    # running first (in submission order), then queued, then ended jobs
    order = [_line(lines, job) for job in ("long", "short", "waits", "bad", "done-job")]
    assert order == sorted(order), out
    long = lines[_line(lines, "long")]
    assert "1 (1..4)" in long and "412/100000" in long and "65min" in long
    assert "shrunk 4->1: made room for short [sweep]" in long  # markup-looking text kept
    assert long.count("█") == 1 and long.count("·") == 3  # a cell per worker of the 4
    short = lines[_line(lines, "short")]
    assert "3* (1..4)" in short and "7/30" in short and "12s" in short  # * while resizing
    assert "#1 by remaining work" in short
    waits = lines[_line(lines, "waits")]
    assert "queued" in waits and "no room" in waits and "█" not in waits
    bad = lines[_line(lines, "bad")]
    assert "WorkerError: user code failed on rank 0" in bad  # a failed job's error is its why
    assert "loop errors: RuntimeError: boom [x]" in out


def test_an_empty_queue_and_an_unknown_scheduler_render():
    out = _text(render_queue([], {}))
    assert "the queue is empty" in out and "scheduler ?" in out


def test_watch_redraws_what_it_fetches():
    from rich.console import Console

    seen: list[int] = []

    def fetch():
        seen.append(1)
        return [_row("j", "running", 2, step=len(seen), remaining_s=1.0)], INFO

    c = Console(file=io.StringIO(), width=160, force_terminal=False, record=True)
    watch(fetch, console=c, interval_s=0.0, max_rounds=3)
    assert len(seen) == 3
    assert "3/100" in c.export_text()


def test_watch_into_a_file_writes_each_change_as_it_comes():
    """``elastic queue watch > file`` (no terminal) stopped by a signal. Was: nothing written
    (a Live redraw writes to a file only when it ends)."""
    from rich.console import Console

    calls: list[int] = []

    def fetch():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return [_row("j", "running", 2, step=min(len(calls), 2), remaining_s=1.0)], INFO

    out = io.StringIO()
    watch(fetch, console=Console(file=out, width=160, force_terminal=False), interval_s=0.0,
          progress_every_s=0.0)
    text = out.getvalue()
    assert text.count("1/100") == 1 and text.count("2/100") == 1, text  # changes only


def test_watch_into_a_file_prints_progress_alone_at_most_every_so_often():
    """A running job's steps and time left change every round. Was: a table written into the
    file every interval while any job ran. Now a change of state (or workers, reason, the
    scheduler's line) is printed at once, progress alone at most every ``progress_every_s``,
    and the last table at the end; what the table does not show (the scheduler's clock, a
    job's worker-seconds) prints nothing."""
    from rich.console import Console

    states = ["running"] * 5 + ["finished"] + ["finished"] * 3

    def fetch():  # as the scheduler answers: its clock and the worker-seconds move too
        i = len(seen)
        seen.append(i)
        return ([_row("j", states[i], 2, step=i + 1, remaining_s=9.0 - i, worker_s=2.0 * i)],
                dict(INFO, now_s=100.0 + i))

    seen: list[int] = []
    out = io.StringIO()
    watch(fetch, console=Console(file=out, width=160, force_terminal=False), interval_s=0.0,
          max_rounds=len(states), progress_every_s=3600.0)
    text = out.getvalue()
    assert len(seen) == len(states)
    # the first table, the change to finished (step 6), the last (step 9); no other step
    assert [n for n in range(1, 10) if f" {n}/100" in text] == [1, 6, 9], text


def test_queue_lines_keep_long_job_names_apart_from_their_state():
    """`elastic queue list`: a sweep's trial names (``<study>-trial-<n>``) are longer than
    the job column was, and ran into the state ("sweep-demo-trial-1finished")."""
    from elastic.sched_cli import format_queue

    row = dict(workers=0, min_workers=1, max_workers=2, step=60, max_steps=60,
               remaining_s=0.0, state="finished", reason="finished")
    lines = format_queue([dict(row, job="sweep-demo-trial-1"), dict(row, job="a")]).splitlines()
    assert lines[2].split()[:2] == ["sweep-demo-trial-1", "finished"]
    assert lines[3].split()[:2] == ["a", "finished"]
    assert lines[2].index("finished") == lines[3].index("finished") == lines[0].index("state")


def test_a_running_job_whose_workers_are_starting_shows_starting_and_its_start_is_printed():
    """The scheduler counts a job running from its start (it holds its workers), while
    its workers may take seconds (a GPU node's image: minutes) to start: the queue shows
    "starting" until they are placed and grouped, and into a file the change to running is
    printed at once (a state change), not with the progress at most once a minute."""
    from rich.console import Console

    from elastic.sched_cli import format_queue

    starting = _row("j", "running", 2, phase="placing", remaining_s=9.0)
    assert format_queue([starting]).splitlines()[2].split()[:2] == ["j", "starting"]
    assert format_queue([dict(starting, phase="at_boundary")]).splitlines()[2].split()[1] == \
        "running"
    phases = ["starting", "placing", "placing", "running", "running"]

    def fetch():
        i = len(seen)
        seen.append(i)
        return [_row("j", "running", 2, phase=phases[i], step=i, remaining_s=9.0)], INFO

    seen: list[int] = []
    out = io.StringIO()
    watch(fetch, console=Console(file=out, width=160, force_terminal=False), interval_s=0.0,
          max_rounds=len(phases), progress_every_s=3600.0)
    text = out.getvalue()
    tables = text.split("elastic queue")[1:]
    assert len(tables) == 3, text  # the first, the change to running, the last
    assert ["starting" in t for t in tables] == [True, False, False], text


def test_into_a_file_the_table_is_wide_enough_for_its_states_and_reasons(monkeypatch, capsys):
    """`elastic queue watch > file`: rich's 80 columns cut "starting" to "starti…" and
    wrapped each reason over six lines (a scheduler walked live); without COLUMNS the file
    gets ``FILE_WIDTH``."""
    from elastic.queue_view import FILE_WIDTH

    monkeypatch.delenv("COLUMNS", raising=False)
    row = _row("second", "running", 1, phase="placing", remaining_s=4.0,
               reason="#1 by remaining work; keeps 1 worker (2 would save under 1s); 4s left")
    watch(lambda: ([row], INFO), interval_s=0.0, max_rounds=1)
    text = capsys.readouterr().out
    assert "starting" in text and "4s left" in text, text
    assert "0 running, 1 starting, 0 queued" in text, text
    assert max(len(ln) for ln in text.splitlines()) <= FILE_WIDTH


def test_scheduler_start_refuses_worker_counts_that_disagree():
    """``--workers 4 --gpus 2``: one count given two ways, differently: refused, naming both.
    Was: ``--workers`` won and ``--gpus`` was ignored silently."""
    import argparse

    from elastic.sched_cli import _start

    a = argparse.Namespace(workers=4, cpus=None, gpus=2)
    with pytest.raises(SystemExit, match="--workers 4, --gpus 2 disagree"):
        _start(a)
