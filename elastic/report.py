"""Reports of a finished (or running) job from its run directory: a PNG, an HTML page, a sidecar.

``write_report(run_dir)`` reads the run log the controller wrote (``metrics.jsonl``,
``events.jsonl``, ``config.json``; see ``elastic.events.RunLog``) and writes, by default into
``run_dir``:

- ``report.png``: loss, throughput (samples/s) and world size over steps (or wall time), with
  the job's notable events (failure, recovered, switch, joined, checkpoint, ...) drawn as
  vertical lines in one colour per kind, labelled on the top panel;
- ``report.html``: one self-contained page (the PNG embedded as base64, a summary and the full
  events table), nothing fetched from elsewhere;
- ``report.json``: where things landed in the image (figure size, each panel's pixel box and
  data limits, each event marker's x pixel and colour), so a test or a script can check the
  picture without trusting it.

matplotlib is imported lazily with the Agg backend (``pip install 'elastic[report]'``).
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ElasticError

__all__ = ["ReportError", "RunData", "ReportFiles", "load_run", "write_report", "EVENT_COLORS",
           "ROUTINE_EVENTS"]


class ReportError(ElasticError):
    """A report cannot be made: no run directory, no metrics, or no plotting library."""


# One distinctive, exact colour per event kind (lines are drawn without antialiasing, so these
# are the very pixel values in the PNG). None of them is used by the data lines.
EVENT_COLORS: dict[str, str] = {
    "failure": "#e00000",
    "failed": "#800000",
    "recovered": "#00b000",
    "switch": "#8000ff",
    "switch_refused": "#ff80c0",
    "joined": "#00a0e0",
    "waiting": "#ffa000",
    "checkpoint": "#a05000",
    "stopped": "#000000",
    "plan": "#00c0a0",
    "control_lost": "#808000",
    "preemption_notice": "#ff6000",
    "evacuated": "#0040c0",
    "evacuation_failed": "#600060",
    "resumed": "#b8860b",
    "restored": "#2e8b57",
    "interrupted": "#ff1493",
}
OTHER_EVENT_COLOR = "#c000c0"  # kinds not listed above and not routine
# Start-up and bookkeeping: listed in the HTML table, not drawn on the plot.
# unprotected: a setting, not an incident; claimed: the checkpoint URI taken for the job;
# evacuating: the decision an "evacuated" (or a failure) follows; replan: a switch follows
# when it changes anything
ROUTINE_EVENTS = frozenset({"start", "placed", "group", "layout", "finished", "profiled",
                            "state", "unprotected", "settings_unused", "parameters_left_out",
                            "batch_dependent",
                            "claimed", "evacuating", "replan", "tracker"})
# drawn, but named by the legend only: every few steps, their labels ran into one band
UNLABELLED_EVENTS = frozenset({"checkpoint"})

_LOSS_COLOR = "#1f77b4"
_SPEED_COLOR = "#2f6f2f"
_WORLD_COLOR = "#404040"
_DPI = 100
_FIGSIZE = (12.0, 8.0)  # inches: 1200 x 800 pixels at _DPI
_MAX_LABELS = 40
_SHIFT_PX = 4.0


@dataclass
class RunData:
    """What a run directory holds, parsed."""

    run_dir: str
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    skipped_lines: int = 0
    rerun_steps: int = 0  # records of steps a recovery ran again (only the last one is kept)

    @property
    def job(self) -> str:
        return str(self.config.get("name") or os.path.basename(os.path.normpath(self.run_dir)))

    @property
    def t0(self) -> float:
        times = [e["time"] for e in self.events if _num(e.get("time"))]
        times += [m["time"] for m in self.metrics if _num(m.get("time"))]
        return min(times) if times else 0.0


@dataclass
class ReportFiles:
    png: str
    html: str
    sidecar: str
    layout: dict[str, Any]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    """Lines that parse as JSON objects, and how many did not (a job killed mid-write leaves a
    torn last line; a report should still be possible)."""
    out: list[dict[str, Any]] = []
    bad = 0
    if not os.path.exists(path):
        return out, bad
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(obj, dict):
                out.append(obj)
            else:
                bad += 1
    return out, bad


def load_run(run_dir: str) -> RunData:
    """Parse a run directory; raise ``ReportError`` naming the fix when there is nothing to plot."""
    if not os.path.isdir(run_dir):
        what = "is a file, not a directory" if os.path.exists(run_dir) else "does not exist"
        raise ReportError(
            f"run directory {run_dir} {what}. Fix: pass the run_dir of a job (by default "
            "./runs/<job name>; `elastic run` prints it when the job ends)."
        )
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics, bad_m = _read_jsonl(metrics_path)
    events, bad_e = _read_jsonl(os.path.join(run_dir, "events.jsonl"))
    metrics = [m for m in metrics if isinstance(m.get("step"), int)]
    if not metrics:
        why = "has no metrics.jsonl" if not os.path.exists(metrics_path) else \
            "has no completed step in metrics.jsonl"
        raise ReportError(
            f"run directory {run_dir} {why}, so there is nothing to plot. Fix: point at the "
            "directory of a job that completed at least one step (it holds metrics.jsonl and "
            "events.jsonl)."
        )
    # a recovery runs the steps since its restore point again: the step's last record is the
    # one that counts (plotting both drew the world size back and forth over those steps)
    last: dict[int, dict[str, Any]] = {}
    for m in metrics:
        last[m["step"]] = m
    rerun = len(metrics) - len(last)
    metrics = sorted(last.values(), key=lambda m: m["step"])
    config: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            loaded = json.load(f)
        if isinstance(loaded, dict):
            config = loaded
    except (OSError, json.JSONDecodeError):
        pass
    return RunData(run_dir, metrics, events, config, bad_m + bad_e, rerun)


def event_color(kind: str) -> str | None:
    """The marker colour of an event kind; None for routine kinds (not drawn)."""
    if kind in ROUTINE_EVENTS:
        return None
    return EVENT_COLORS.get(kind, OTHER_EVENT_COLOR)


def _event_x(ev: dict[str, Any], run: RunData, x_axis: str) -> float | None:
    """Where an event goes on the x axis. Steps: the boundary it happened at (``step`` = steps
    completed); events without a step are placed by their time between the steps around it."""
    if x_axis == "time":
        return ev["time"] - run.t0 if _num(ev.get("time")) else None
    if isinstance(ev.get("step"), int):
        return float(ev["step"])
    if not _num(ev.get("time")):
        return None
    pts = [(m["time"], m["step"] + 1) for m in run.metrics if _num(m.get("time"))]
    if not pts:
        return None
    import numpy as np

    ts, ss = zip(*pts, strict=True)
    return float(np.interp(ev["time"], ts, ss))


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ReportError(
            "reports need matplotlib, which is not installed. Fix: pip install 'elastic[report]'"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _bbox_px(ax: Any, height: int) -> list[float]:
    """An axes' box in image pixels, origin top-left: [left, top, right, bottom]."""
    b = ax.get_window_extent()
    return [b.x0, height - b.y1, b.x1, height - b.y0]


def write_report(run_dir: str, out_dir: str | None = None, x_axis: str = "step") -> ReportFiles:
    """Write ``report.png``, ``report.html`` and ``report.json`` for a run; return their paths
    and the layout (the sidecar's content)."""
    if x_axis not in ("step", "time"):
        raise ReportError(f"x axis {x_axis!r} is unknown. Fix: use 'step' or 'time'.")
    run = load_run(run_dir)
    plt = _plt()
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)

    ms = run.metrics
    t0 = run.t0
    if x_axis == "step":
        xs = [m["step"] + 1 for m in ms]  # steps completed after this one
        xlabel = "steps completed"
    else:
        xs = [(m["time"] - t0) if _num(m.get("time")) else float("nan") for m in ms]
        xlabel = "wall time since start (s)"
    loss = [m["loss"] if _num(m.get("loss")) else float("nan") for m in ms]
    # a step completed while a worker was lost (a ``note``) has no speed: None since session
    # 43, 0.0 in runs written before (drawn as a drop that never happened)
    speed = [m["samples_per_s"] if _num(m.get("samples_per_s")) and "note" not in m
             else float("nan") for m in ms]
    world = [float(m["world_size"]) if _num(m.get("world_size")) else float("nan") for m in ms]

    fig, (ax_loss, ax_speed, ax_world) = plt.subplots(
        3, 1, sharex=True, figsize=_FIGSIZE, dpi=_DPI,
        gridspec_kw={"height_ratios": [3, 2, 1], "left": 0.08, "right": 0.97, "top": 0.92,
                     "bottom": 0.14, "hspace": 0.08},
    )
    again = f" ({run.rerun_steps} run again after a recovery)" if run.rerun_steps else ""
    fig.suptitle(f"elastic run {run.job}: {len(ms)} steps{again}", fontsize=12)
    ax_loss.plot(xs, loss, color=_LOSS_COLOR, linewidth=1.2, label="loss")
    finite = [v for v in loss if _num(v) and v > 0]
    if finite and max(finite) / min(finite) > 50:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_speed.plot(xs, speed, color=_SPEED_COLOR, linewidth=1.0, label="samples/s")
    ax_speed.set_ylabel("samples/s")
    # a step runs between the boundaries x - 1 and x: its world size holds over that interval
    first = xs[0] - 1 if x_axis == "step" else xs[0] - float(ms[0].get("step_time") or 0.0)
    ax_world.step([first, *xs], [world[0], *world], where="pre", color=_WORLD_COLOR, linewidth=2.0,
                  antialiased=False, label="world size")
    ax_world.set_ylabel("workers")
    wmax = max((w for w in world if _num(w)), default=1)
    ax_world.set_ylim(0, wmax + 1)
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    ax_world.set_xlabel(xlabel)
    # strategy segments, named on the world-size panel where they begin
    prev = None
    for x, m in zip(xs, ms, strict=True):
        s = m.get("strategy")
        if s != prev and _num(x):
            begin = x - 1 if x_axis == "step" else x - float(m.get("step_time") or 0.0)
            ax_world.annotate(str(s), (begin, 0), xytext=(2, 2), textcoords="offset points",
                              fontsize=8, color=_WORLD_COLOR, va="bottom", ha="left")
            prev = s
    for ax in (ax_loss, ax_speed, ax_world):
        ax.grid(True, color="#e8e8e8", linewidth=0.6)
    finite_x = [x for x in xs if _num(x)]
    lo, hi = (min(finite_x), max(finite_x)) if finite_x else (0.0, 1.0)
    lo = min(lo, 0.0) if x_axis == "step" else lo

    # events: one vertical line per notable event on every panel, drawn last and above the data
    drawn: list[tuple[dict[str, Any], float, str]] = []
    for ev in run.events:
        kind = str(ev.get("kind", ""))
        color = event_color(kind)
        if color is None:
            continue
        x = _event_x(ev, run, x_axis)
        if x is None or not math.isfinite(x):
            continue
        drawn.append((ev, x, color))
        lo, hi = min(lo, x), max(hi, x)
    pad = max(0.5, 0.01 * (hi - lo))
    ax_loss.set_xlim(lo - pad, hi + pad)
    # markers at the same x (a failure and its recovery) stand side by side, _SHIFT_PX apart
    from matplotlib.transforms import offset_copy

    seen: dict[float, int] = {}
    shifts = []
    for _ev, x, color in drawn:
        k = seen.get(x, 0)
        seen[x] = k + 1
        shifts.append(k * _SHIFT_PX)
        for ax in (ax_loss, ax_speed, ax_world):
            tr = offset_copy(ax.get_xaxis_transform(), fig=fig, x=k * _SHIFT_PX, units="dots")
            ax.plot([x, x], [0, 1], transform=tr, color=color, linewidth=2.0, antialiased=False,
                    zorder=5, solid_capstyle="butt")
    labelled = [(i, ev, x, color) for i, (ev, x, color) in enumerate(drawn)
                if str(ev.get("kind")) not in UNLABELLED_EVENTS][:_MAX_LABELS]
    for j, (i, ev, x, color) in enumerate(labelled):
        ax_loss.annotate(str(ev.get("kind")), (x, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3 + shifts[i] * 72 / _DPI, -4 - 10 * (j % 3)),
                         textcoords="offset points", fontsize=8, color=color, va="top",
                         ha="left", zorder=6)
    kinds = list(dict.fromkeys(str(ev.get("kind")) for ev, _, _ in drawn))
    if kinds:
        from matplotlib.lines import Line2D

        fig.legend([Line2D([], [], color=event_color(k), linewidth=2) for k in kinds], kinds,
                   loc="lower center", ncol=min(len(kinds), 8), frameon=False, fontsize=9,
                   title="events", title_fontsize=9)

    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    axes = {}
    for name, ax in (("loss", ax_loss), ("samples_per_s", ax_speed), ("world_size", ax_world)):
        axes[name] = {"bbox_px": _bbox_px(ax, height), "xlim": list(ax.get_xlim()),
                      "ylim": list(ax.get_ylim()), "yscale": ax.get_yscale()}
    markers = []
    named = {i for i, *_ in labelled}
    for i, ((ev, x, color), shift) in enumerate(zip(drawn, shifts, strict=True)):
        px = float(ax_loss.transData.transform((x, 0.0))[0]) + shift
        markers.append({"kind": ev.get("kind"), "step": ev.get("step"), "x": x, "x_px": px,
                        "color": color, "message": ev.get("message", ""),
                        "labelled": i in named})
    layout = {
        "width_px": width, "height_px": height, "dpi": _DPI, "x_axis": x_axis, "axes": axes,
        "markers": markers, "colors": {"loss": _LOSS_COLOR, "samples_per_s": _SPEED_COLOR,
                                       "world_size": _WORLD_COLOR, "events": EVENT_COLORS},
        "marker_linewidth_px": 2.0 * _DPI / 72.0,
    }
    png = os.path.join(out_dir, "report.png")
    fig.savefig(png, dpi=_DPI)
    plt.close(fig)
    sidecar = os.path.join(out_dir, "report.json")
    with open(sidecar, "w") as f:
        json.dump(layout, f, indent=1)
    page = os.path.join(out_dir, "report.html")
    with open(page, "w") as f:
        f.write(_html(run, png, xlabel))
    return ReportFiles(png, page, sidecar, layout)


def _html(run: RunData, png: str, xlabel: str) -> str:
    with open(png, "rb") as f:
        b64 = base64.b64encode(f.read()).decode("ascii")
    ms = run.metrics
    last = ms[-1]
    losses = [m["loss"] for m in ms if _num(m.get("loss"))]
    speeds = [m["samples_per_s"] for m in ms if _num(m.get("samples_per_s")) and
              m["samples_per_s"] > 0]
    worlds = sorted({m["world_size"] for m in ms if _num(m.get("world_size"))})
    strategies = list(dict.fromkeys(str(m.get("strategy")) for m in ms))
    e = html.escape
    summary = [
        ("job", run.job), ("run directory", os.path.abspath(run.run_dir)),
        ("steps completed", str(last["step"] + 1)),
        ("steps run again after a recovery", str(run.rerun_steps)),
        ("final loss", f"{losses[-1]:.4f}" if losses else "-"),
        ("mean samples/s", f"{sum(speeds) / len(speeds):,.0f}" if speeds else "-"),
        ("world sizes", ", ".join(str(int(w)) for w in worlds) or "-"),
        ("strategies", " → ".join(strategies)),
    ]
    if run.skipped_lines:
        summary.append(("unreadable log lines skipped", str(run.skipped_lines)))
    rows = []
    for ev in run.events:
        kind = str(ev.get("kind", ""))
        color = event_color(kind)
        raw_t = ev.get("time")
        t = float(raw_t) if raw_t is not None and _num(raw_t) else None
        rows.append(
            "<tr><td>{}</td><td>{}</td><td style=\"color:{}\"><b>{}</b></td><td>{}</td></tr>".format(
                f"{t - run.t0:.1f}s" if t is not None else "",
                e(str(ev.get("step"))) if ev.get("step") is not None else "",
                color or "#606060", e(kind), e(str(ev.get("message", "")))))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>elastic run {e(run.job)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}}
img{{max-width:100%}}</style></head><body>
<h1>elastic run {e(run.job)}</h1>
<table class="summary">{''.join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary)}</table>
<p><img alt="loss, samples/s and world size over {e(xlabel)}, with events" src="data:image/png;base64,{b64}"></p>
<h2>events</h2>
<table class="events"><tr><th>time</th><th>step</th><th>kind</th><th>message</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
