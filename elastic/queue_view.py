"""The live view of a scheduler's queue (``elastic queue watch``): every job, its state,
allocation, steps, predicted time left and why the scheduler decided what it did.

``render_queue(rows, info)`` is a pure function of the queue's state (the scheduler's
``rows()`` and ``info()``, as ``elastic queue list --json`` prints them) to a rich
renderable, so a test renders it to a string; ``watch`` only fetches and redraws it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["render_queue", "shown_state", "watch", "STATE_STYLE"]

# a running job's controller phases before its first step: its workers are still starting
# (a cold worker takes seconds here, a GPU node's image minutes), nothing trains yet
_STARTING = ("starting", "placing", "forming")
FILE_WIDTH = 160  # a table's width into a file or a pipe (no terminal, no COLUMNS)


def shown_state(row: dict[str, Any]) -> str:
    """A job's state as the queue shows it: ``starting`` for a running job whose workers
    are not placed and grouped yet (the scheduler counts it running: it holds its
    workers), else the scheduler's state."""
    state = str(row.get("state"))
    return "starting" if state == "running" and row.get("phase") in _STARTING else state


STATE_STYLE = {"queued": "yellow", "starting": "cyan", "running": "green", "finished": "blue",
               "cancelled": "magenta", "failed": "red"}
_ORDER = {"running": 0, "queued": 1, "failed": 2, "cancelled": 3, "finished": 4}


def _secs(s: Any) -> str:
    if s is None or not isinstance(s, (int, float)) or not math.isfinite(s):
        return "-"
    return f"{s:.0f}s" if s < 600 else f"{s / 60:.0f}min"


def render_queue(rows: list[dict[str, Any]], info: dict[str, Any] | None = None,
                 width: int = 24) -> Any:
    """A panel: the scheduler's line (name, policy, workers in use of its capacity,
    decisions, recent loop errors), then one row per job, running first, then queued (in
    submission order), then ended ones: state, workers (``*`` while a resize is under way)
    of min..max and a bar of the capacity, steps done of all, predicted remaining time,
    resizes, and why (the policy's reason, or the error of a failed job)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    info = info or {}
    cap = int(info.get("workers") or 0)
    used = sum(int(r.get("workers") or 0) for r in rows if r.get("state") == "running")
    states = [shown_state(r) for r in rows]
    head = Table.grid(padding=(0, 2))
    head.add_row(f"[bold]scheduler {escape(str(info.get('name', '?')))}[/]",
                 f"policy [magenta]{escape(str(info.get('policy', '?')))}[/]",
                 f"workers {used}/{cap if cap else '?'} in use",
                 f"{states.count('running')} running, "
                 + (f"{states.count('starting')} starting, " if "starting" in states else "")
                 + f"{states.count('queued')} queued",
                 f"decisions {info.get('decisions', 0)}")
    t = Table(expand=False, show_edge=False)
    for col, just in (("job", "left"), ("state", "left"), ("workers", "right"),
                      ("allocation", "left"), ("steps", "right"), ("left", "right"),
                      ("resizes", "right"), ("why", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    ordered = sorted(zip(rows, states, strict=True),
                     key=lambda rs: (_ORDER.get(str(rs[0].get("state")), 5),
                                     rs[0].get("submitted_s") or 0.0))
    for r, shown in ordered:
        state = str(r.get("state"))
        n = int(r.get("workers") or 0)
        bar_w = max(1, min(width, cap)) if cap else width
        filled = round(bar_w * n / cap) if cap else 0
        bar = "[green]" + "█" * filled + "[/][dim]" + "·" * (bar_w - filled) + "[/]"
        workers = (f"{n}{'*' if r.get('resizing') else ''} "
                   f"({r.get('min_workers')}..{r.get('max_workers')})")
        step = f"{r.get('step', 0)}/{r.get('max_steps')}"
        left = _secs(r.get("remaining_s")) if state == "running" else "-"
        why = r.get("error") or r.get("reason") or ""
        style = STATE_STYLE.get(shown, "white")
        t.add_row(escape(str(r.get("job"))), f"[{style}]{escape(shown)}[/]", workers,
                  bar if state == "running" else "", step, left, str(r.get("resizes", 0)),
                  escape(str(why)))
    parts: list[Any] = [head, t if rows else "[dim]the queue is empty[/]"]
    errors = info.get("errors") or []
    if errors:
        parts.append("[red]loop errors:[/] " + escape("; ".join(map(str, errors[-3:]))))
    return Panel(Group(*parts), title="elastic queue", border_style="blue")


# what the table shows of a job and of the scheduler (not the clock, ``now_s``, nor the
# worker-seconds, which change every round); a running job's progress separately
_SHOWN_ROW = ("job", "state", "workers", "resizing", "min_workers", "max_workers",
              "max_steps", "resizes", "reason", "error")
_SHOWN_INFO = ("name", "policy", "workers", "decisions", "errors")


def watch(fetch: Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]], *,
          console: Any = None, interval_s: float = 1.0, until: Callable[[], bool] | None = None,
          max_rounds: int | None = None, progress_every_s: float = 60.0) -> None:
    """Redraw ``render_queue(*fetch())`` every ``interval_s`` until ``until()`` (or Ctrl-C,
    or ``max_rounds`` redraws). Into a pipe or a file (no terminal) the table is printed
    again when what it shows changes (a Live redraw writes nothing there until it ends): at
    once for a job's state, workers, reason or the scheduler's line; when only steps and
    time left moved, at most every ``progress_every_s``; and the last table at the end.
    There, without ``COLUMNS``, tables are ``FILE_WIDTH`` wide (rich's 80 cut the states
    and wrapped every reason over six lines)."""
    import os

    from rich.console import Console
    from rich.live import Live

    if console is None:
        console = Console()
        if not console.is_terminal and not os.environ.get("COLUMNS"):
            console = Console(width=FILE_WIDTH)
    rounds = _rounds(fetch, interval_s, until, max_rounds)
    if not console.is_terminal:
        printed: Any = None  # what the last table printed showed: (the rest, progress)
        last: Any = None
        at = 0.0
        for last in rounds:
            rest, progress = _shown(*last)
            if printed is not None and rest == printed[0] and (
                    progress == printed[1] or time.monotonic() - at < progress_every_s):
                continue
            console.print(render_queue(*last))
            printed, at = (rest, progress), time.monotonic()
        if last is not None and _shown(*last) != printed:
            console.print(render_queue(*last))
        return
    with Live("", console=console, refresh_per_second=4) as live:
        for now in rounds:
            live.update(render_queue(*now))


def _shown(rows: list[dict[str, Any]], info: dict[str, Any]) -> tuple[Any, Any]:
    """What ``render_queue(rows, info)`` shows: everything but the running jobs' progress,
    and that progress (steps, time left as printed)."""
    rest = (tuple((shown_state(r), *(r.get(k) for k in _SHOWN_ROW)) for r in rows),
            tuple(str(info.get(k)) for k in _SHOWN_INFO))
    progress = tuple((r.get("step"), _secs(r.get("remaining_s"))
                      if r.get("state") == "running" else "-") for r in rows)
    return rest, progress


def _rounds(fetch: Callable[[], Any], interval_s: float, until: Callable[[], bool] | None,
            max_rounds: int | None) -> Iterator[Any]:
    """``fetch()`` now and every ``interval_s`` after, until ``until()``, ``max_rounds``
    fetches or Ctrl-C."""
    done = 0
    try:
        while True:
            yield fetch()
            done += 1
            if (until is not None and until()) or (max_rounds is not None
                                                   and done >= max_rounds):
                return
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return
