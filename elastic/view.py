"""The live view: a rich display on a terminal, plain log lines elsewhere.

Views are fed by the controller (``workers``, ``step``, ``event``); they never call back.
``RichView`` takes an injectable console and clock so tests render it to a string.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from .events import Event

__all__ = ["View", "PlainView", "RichView", "NullView", "make_view"]


class View:
    """Base: ignores everything. Subclasses override what they show."""

    def start(self, job: str, max_steps: int) -> None: ...
    def workers(self, infos: list[dict[str, Any]]) -> None: ...
    def step(self, entry: dict[str, Any]) -> None: ...
    def event(self, ev: Event) -> None: ...
    def close(self) -> None: ...


NullView = View


class PlainView(View):
    """One line per ``log_every`` steps and one per event, for logs and pipes."""

    def __init__(self, out: TextIO | None = None, log_every: int = 1) -> None:
        self.out = out or sys.stdout
        self.log_every = max(1, log_every)
        self.max_steps = 0
        self._shown: list[tuple[Any, ...]] = []

    def _p(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def start(self, job: str, max_steps: int) -> None:
        self.max_steps = max_steps
        self._p(f"[elastic] job {job}: {max_steps} steps")

    def workers(self, infos: list[dict[str, Any]]) -> None:
        key = [(i.get("rank"), i.get("node_id"), i.get("device_name")) for i in infos]
        if key == self._shown:
            return
        self._shown = key
        for i in infos:
            emu = _emulated_mark(i, " (emulated)")
            self._p(f"[elastic] worker rank {i.get('rank')} on {i.get('hostname')} "
                    f"node {str(i.get('node_id'))[:8]} device {i.get('device_name')}{emu}")

    def step(self, e: dict[str, Any]) -> None:
        s = e["step"] + 1
        if s % self.log_every == 0 or s == self.max_steps:
            self._p(f"[elastic] step {s}/{self.max_steps} loss {e['loss']:.4f} "
                    f"{e['samples_per_s'] or 0:.0f} samples/s world {e['world_size']} "
                    f"strategy {e['strategy']}{_optim_line(e)}")

    def event(self, ev: Event) -> None:
        at = f" at step {ev.step}" if ev.step is not None else ""
        if ev.kind == "failed":  # the error itself is raised (`elastic run` prints it as its
            # one line); the start's checks are no step's failure (the controller says which)
            where = at if ev.data.get("in_step") else " before any step ran"
            self._p(f"[elastic] failed{where}: its error is raised to the caller")
            return
        self._p(f"[elastic] {ev.kind}{at}: {ev.message}")


class RichView(View):
    """A live panel: progress, loss, throughput, workers and their devices, recent events."""

    def __init__(self, console: Any = None, clock: Callable[[], float] = time.time,
                 live: bool = True) -> None:
        from rich.console import Console

        self.console = console or Console()
        self.clock = clock
        self._live_enabled = live
        self._live: Any = None
        self.job = ""
        self.max_steps = 0
        self.last: dict[str, Any] | None = None
        self.infos: list[dict[str, Any]] = []
        self.events: deque[Event] = deque(maxlen=8)
        self.t0 = clock()

    def start(self, job: str, max_steps: int) -> None:
        self.job, self.max_steps, self.t0 = job, max_steps, self.clock()
        if self._live_enabled:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.start()

    def workers(self, infos: list[dict[str, Any]]) -> None:
        self.infos = list(infos)
        self._refresh()

    def step(self, entry: dict[str, Any]) -> None:
        self.last = entry
        self._refresh()

    def event(self, ev: Event) -> None:
        self.events.append(ev)
        self._refresh()

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def render(self) -> Any:
        from rich.console import Group
        from rich.markup import escape
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        e = self.last or {}
        done = (e.get("step", -1) + 1) if e else 0
        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"[bold]{escape(self.job)}[/]", f"step {done}/{self.max_steps}",
            f"loss [cyan]{e.get('loss', float('nan')):.4f}[/]",
            f"{e.get('samples_per_s') or 0.0:,.0f} samples/s",
            f"strategy [magenta]{escape(str(e.get('strategy', '-')))}[/]",
            f"world {e.get('world_size', len(self.infos))}",
            f"{self.clock() - self.t0:,.0f}s",
            *([escape(_optim_line(e).strip())] if _optim_line(e) else []),
        )
        bar = ProgressBar(total=max(1, self.max_steps), completed=done, width=60)
        wt = Table(title="workers", expand=False, show_edge=False)
        for col in ("rank", "node", "device", "share", "samples/s", "memory"):
            wt.add_column(col)
        for i in self.infos:
            # worker and event text is data, not markup: a gloo error reads "[/pytorch/...]"
            emu = _emulated_mark(i, " [yellow](emulated)[/]")
            wt.add_row(str(i.get("rank")),
                       escape(f"{i.get('hostname', '')} {str(i.get('node_id', ''))[:6]}"),
                       f"{escape(str(i.get('device_name', '')))}{emu}", escape(str(i.get("share", ""))),
                       f"{i.get('samples_per_s', 0):,.0f}" if i.get("samples_per_s") else "",
                       _fmt_mem(i.get("memory")))
        et = Table(title="events", expand=False, show_edge=False, show_header=False)
        et.add_column("t")
        et.add_column("what")
        for ev in self.events:
            at = f"@{ev.step}" if ev.step is not None else ""
            et.add_row(f"{ev.time - self.t0:6.1f}s",
                       f"[bold]{escape(ev.kind)}[/]{at} {escape(ev.message)}")
        return Panel(Group(head, bar, wt, et), title="elastic", border_style="blue")

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None


def _emulated_mark(info: dict[str, Any], mark: str) -> str:
    """The "(emulated)" mark for an emulated worker, unless its device name already says so
    (workers name emulated devices "T4 (emulated on cpu, x3)")."""
    if not info.get("emulated") or "emulated" in str(info.get("device_name", "")):
        return ""
    return mark


def _fmt_mem(m: Any) -> str:
    if not m:
        return ""
    return " ".join(f"{k[0]}:{v / 1e6:.1f}M" for k, v in m.items())


def make_view(mode: str, log_every: int = 1) -> View:
    """``auto`` picks rich on a terminal and plain lines otherwise."""
    if mode == "none":
        return View()
    if mode == "rich" or (mode == "auto" and sys.stdout.isatty()):
        return RichView()
    return PlainView(log_every=log_every)


def _optim_line(e: dict[str, Any]) -> str:
    """`` lr 3.0e-04 grad norm 0.82 eval loss 1.234`` for a step that has them
    (lr_schedule, max_grad_norm, an evaluation after it)."""
    out = ""
    if e.get("lr") is not None:
        out += f" lr {e['lr']:.2e}"
    if e.get("grad_norm") is not None:
        out += f" grad norm {e['grad_norm']:.3g}"
    if e.get("eval_loss") is not None:
        out += f" eval loss {e['eval_loss']:.4f}"
    return out
