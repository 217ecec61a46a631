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

__all__ = ["render_queue", "watch", "STATE_STYLE"]

STATE_STYLE = {"queued": "yellow", "running": "green", "finished": "blue",
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
    head = Table.grid(padding=(0, 2))
    head.add_row(f"[bold]scheduler {escape(str(info.get('name', '?')))}[/]",
                 f"policy [magenta]{escape(str(info.get('policy', '?')))}[/]",
                 f"workers {used}/{cap if cap else '?'} in use",
                 f"{sum(r.get('state') == 'running' for r in rows)} running, "
                 f"{sum(r.get('state') == 'queued' for r in rows)} queued",
                 f"decisions {info.get('decisions', 0)}")
    t = Table(expand=False, show_edge=False)
    for col, just in (("job", "left"), ("state", "left"), ("workers", "right"),
                      ("allocation", "left"), ("steps", "right"), ("left", "right"),
                      ("resizes", "right"), ("why", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    ordered = sorted(rows, key=lambda r: (_ORDER.get(str(r.get("state")), 5),
                                          r.get("submitted_s") or 0.0))
    for r in ordered:
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
        style = STATE_STYLE.get(state, "white")
        t.add_row(escape(str(r.get("job"))), f"[{style}]{escape(state)}[/]", workers,
                  bar if state == "running" else "", step, left, str(r.get("resizes", 0)),
                  escape(str(why)))
    parts: list[Any] = [head, t if rows else "[dim]the queue is empty[/]"]
    errors = info.get("errors") or []
    if errors:
        parts.append("[red]loop errors:[/] " + escape("; ".join(map(str, errors[-3:]))))
    return Panel(Group(*parts), title="elastic queue", border_style="blue")


def watch(fetch: Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]], *,
          console: Any = None, interval_s: float = 1.0, until: Callable[[], bool] | None = None,
          max_rounds: int | None = None) -> None:
    """Redraw ``render_queue(*fetch())`` every ``interval_s`` until ``until()`` (or Ctrl-C,
    or ``max_rounds`` redraws). Into a pipe or a file (no terminal) the table is printed
    again whenever it changes: a Live redraw writes nothing there until it ends."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    rounds = _rounds(fetch, interval_s, until, max_rounds)
    if not console.is_terminal:
        last = None
        for now in rounds:
            if now != last:
                console.print(render_queue(*now))
                last = now
        return
    with Live("", console=console, refresh_per_second=4) as live:
        for now in rounds:
            live.update(render_queue(*now))


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
