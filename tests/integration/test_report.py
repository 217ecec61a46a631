"""`elastic report RUN_DIR`: the picture is read back and checked pixel by pixel.

The report draws event markers as 2-point vertical lines without antialiasing, in one exact
colour per kind, and writes a sidecar (report.json) saying where each panel and marker landed.
The tests do not take the sidecar's word for it: they recompute each marker's x pixel from the
panel's pixel box and data limits, find the marker colour in the image's pixel rows, and check
that the colour appears nowhere else inside the panels.
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import elastic  # noqa: E402
from elastic.cli import main as cli_main  # noqa: E402
from elastic.events import Event, RunLog  # noqa: E402
from elastic.report import EVENT_COLORS, ReportError, load_run, write_report  # noqa: E402
from tests.helpers import RegressionData, adam, mlp, mse  # noqa: E402


def _rgb(hex_color: str) -> np.ndarray:
    h = hex_color.lstrip("#")
    return np.array([int(h[i:i + 2], 16) for i in (0, 2, 4)])


def _image(path: str) -> np.ndarray:
    import matplotlib.image as mpimg

    im = mpimg.imread(path)
    assert im.dtype == np.float32 and im.ndim == 3  # PNG: floats in [0, 1]
    return np.rint(im[..., :3] * 255).astype(int)


def _expected_x(layout: dict, x: float) -> float:
    """x pixel of data value x on the shared x axis, from the loss panel's box and limits."""
    a = layout["axes"]["loss"]
    left, _, right, _ = a["bbox_px"]
    x0, x1 = a["xlim"]
    return left + (x - x0) / (x1 - x0) * (right - left)


def _cols_with(img: np.ndarray, row: int, color: str, lo: int = 0, hi: int | None = None) -> list[int]:
    seg = img[row, lo:hi]
    return [lo + i for i in np.flatnonzero((seg == _rgb(color)).all(axis=1))]


def _check_image_basics(img: np.ndarray, layout: dict) -> None:
    h, w, _ = img.shape
    assert (w, h) == (layout["width_px"], layout["height_px"]) == (1200, 800)
    white = (img == 255).all(axis=2)
    assert 0.02 < 1 - white.mean() < 0.6, "blank or flooded image"
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20


def _check_markers(img: np.ndarray, layout: dict) -> None:
    """Every marker: at mid-height of every panel, its colour covers 2-4 pixel columns centred
    within 1.5 px of where the axes transform puts it."""
    seen_x: dict[float, int] = {}
    for m in layout["markers"]:
        k = seen_x.get(m["x"], 0)
        seen_x[m["x"]] = k + 1
        want = _expected_x(layout, m["x"]) + 4.0 * k  # side by side when at the same x
        assert abs(want - m["x_px"]) < 1.0, (m, want)
        for name, a in layout["axes"].items():
            _, top, _, bottom = a["bbox_px"]
            for frac in (0.35, 0.5, 0.65):
                row = int(top + frac * (bottom - top))
                cols = _cols_with(img, row, m["color"], int(want) - 4, int(want) + 5)
                assert 2 <= len(cols) <= 4, (m["kind"], name, row, cols, want)
                assert abs(np.mean(cols) + 0.5 - want) <= 1.5, (m["kind"], name, cols, want)


def _check_colour_only_at_markers(img: np.ndarray, layout: dict) -> None:
    """Inside the two lower panels (no labels there), each marker colour appears only within
    3 px of that kind's markers."""
    for name in ("samples_per_s", "world_size"):
        left, top, right, bottom = layout["axes"][name]["bbox_px"]
        rows = range(int(top) + 2, int(bottom) - 2)
        for color in {m["color"] for m in layout["markers"]}:
            xs = [m["x_px"] for m in layout["markers"] if m["color"] == color]
            region = img[rows.start:rows.stop, int(left) + 2:int(right) - 2]
            hit = (region == _rgb(color)).all(axis=2).any(axis=0)
            cols = int(left) + 2 + np.flatnonzero(hit)
            assert len(cols), (name, color)
            for c in cols:
                assert min(abs(c + 0.5 - x) for x in xs) <= 3, (name, color, c, xs)


def _check_html(files, kinds: list[str]) -> None:
    page = open(files.html).read()
    assert "<img" in page and "http://" not in page and "https://" not in page
    b64 = page.split("data:image/png;base64,", 1)[1].split('"', 1)[0]
    assert base64.b64decode(b64) == open(files.png, "rb").read()
    events = page.split('<table class="events">', 1)[1]
    for k in kinds:
        assert f"<b>{k}</b>" in events, k


def test_report_of_a_real_job_with_a_switch(ray_local, tmp_path):
    """A real 6-step job on Ray (dp, switched to zero1 at step 3) -> `elastic report`."""
    run_dir = tmp_path / "run"
    result = elastic.fit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                         global_batch_size=8, max_steps=6, num_workers=2, view="none",
                         name="report-real", run_dir=str(run_dir), switch_at={3: "zero1"})
    assert len(result.history) == 6
    out = tmp_path / "out"
    assert cli_main(["report", str(run_dir), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["report.html", "report.json", "report.png"]
    layout = json.load(open(out / "report.json"))
    img = _image(str(out / "report.png"))
    _check_image_basics(img, layout)
    kinds = [m["kind"] for m in layout["markers"]]
    assert kinds == ["switch"], kinds  # start/placed/group/layout/finished are not drawn
    sw = layout["markers"][0]
    assert sw["x"] == 3 and sw["color"] == EVENT_COLORS["switch"]
    _check_markers(img, layout)
    _check_colour_only_at_markers(img, layout)
    # the loss curve is there: its colour inside the loss panel, in at least 80% of the
    # columns between the first and the last step
    a = layout["axes"]["loss"]
    c0, c1 = int(_expected_x(layout, 1)) + 1, int(_expected_x(layout, 6)) - 1
    panel = img[int(a["bbox_px"][1]) + 1:int(a["bbox_px"][3]) - 1, c0:c1]
    near = (np.abs(panel - _rgb(layout["colors"]["loss"])).sum(axis=2) < 60).any(axis=0)
    assert near.mean() > 0.8
    _check_html(type("F", (), {"html": str(out / "report.html"),
                               "png": str(out / "report.png")}), ["start", "switch", "finished"])


def _synthetic_run(run_dir: str, torn_tail: bool = False) -> None:
    """A run directory in the RunLog format: 30 steps, switch at 10, failure + recovery at 15
    (world 3 -> 2), a checkpoint at 18, a worker joins at 22 (world 2 -> 3), and a kind the
    report does not know."""
    log = RunLog(run_dir)
    log.write_config({"name": "synthetic", "max_steps": 30})
    t = 1000.0

    def ev(kind: str, msg: str, step: int) -> None:
        log.event(Event(kind, msg, step=step, time=t))

    ev("start", "job synthetic", 0)
    ev("placed", "3 workers", 0)
    world, strategy = 3, "dp"
    for s in range(30):
        if s == 10:
            ev("switch", "dp -> zero1", 10)
            strategy = "zero1"
        if s == 15:
            ev("failure", "1 worker(s) lost: [/pytorch/gloo/pair.cc:534] Connection closed <b>", 15)
            world = 2
            t += 2.0
            ev("recovered", "from peers", 15)
        if s == 18:
            ev("checkpoint", "step 18 committed", 18)
        if s == 22:
            ev("joined", "1 worker(s) placed", 22)
            world = 3
        if s == 25:
            ev("rebalanced", "something new", 25)
        t += 0.1
        log.metric({"step": s, "loss": 2.0 * math.exp(-s / 10) + 0.05,
                    "samples_per_s": 100.0 * world + s % 3, "step_time": 0.1,
                    "world_size": world, "strategy": strategy, "time": t, "generation": 1})
    ev("finished", "30 steps", 30)
    log.close()
    if torn_tail:
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write('{"step": 30, "loss": 0.1, "samp')


def test_report_marks_failure_recovery_checkpoint_and_world_size(tmp_path):
    run_dir = str(tmp_path / "run")
    _synthetic_run(run_dir, torn_tail=True)
    assert load_run(run_dir).skipped_lines == 1
    files = write_report(run_dir)
    assert os.path.dirname(files.png) == run_dir  # default: next to the logs
    layout = files.layout
    img = _image(files.png)
    _check_image_basics(img, layout)
    got = [(m["kind"], m["x"]) for m in layout["markers"]]
    assert got == [("switch", 10), ("failure", 15), ("recovered", 15), ("checkpoint", 18),
                   ("joined", 22), ("rebalanced", 25)]
    # a checkpoint (every few steps) is named by the legend only: labels ran into one band
    assert [m["labelled"] for m in layout["markers"]] == [True, True, True, False, True, True]
    colors = [m["color"] for m in layout["markers"]]
    assert len(set(colors)) == len(colors)  # one distinct colour per kind
    assert colors[1] == EVENT_COLORS["failure"] and colors[2] == EVENT_COLORS["recovered"]
    _check_markers(img, layout)
    _check_colour_only_at_markers(img, layout)
    # world size: 3 over steps 1-15, 2 over 16-22, 3 again after; the line's pixel row moves
    a = layout["axes"]["world_size"]
    left, top, right, bottom = a["bbox_px"]
    y0, y1 = a["ylim"]

    def row_of(w: float) -> float:
        return bottom - (w - y0) / (y1 - y0) * (bottom - top)

    world_color = layout["colors"]["world_size"]
    for step_x, w in ((5.5, 3), (12.5, 3), (18.5, 2), (20.5, 2), (26.5, 3)):
        col = int(_expected_x(layout, step_x))
        column = img[int(top):int(bottom), col]
        rows = int(top) + np.flatnonzero((column == _rgb(world_color)).all(axis=1))
        assert len(rows) >= 2, (step_x, w)
        assert abs(np.mean(rows) + 0.5 - row_of(w)) <= 2.0, (step_x, w, rows, row_of(w))
    # HTML: every event in the table, messages escaped
    _check_html(files, ["start", "placed", "switch", "failure", "recovered", "checkpoint",
                        "joined", "rebalanced", "finished"])
    page = open(files.html).read()
    assert "Connection closed &lt;b&gt;" in page and "unreadable log lines skipped" in page


def test_steps_run_again_after_a_recovery_are_drawn_once(tmp_path):
    """Steps 15-17 ran on 3 workers, a node went, the job restored step 15 and ran 15-29 on 2:
    each step is drawn once, as it counted (the world-size line went 3 -> 2 -> 3 -> 2 over
    the re-run steps, as in `elastic demo --chaos`'s report), and the title says 3 ran again."""
    run_dir = str(tmp_path / "run")
    log = RunLog(run_dir)
    log.write_config({"name": "rerun", "max_steps": 30})
    t = 1000.0
    log.event(Event("start", "job rerun", step=0, time=t))
    for i, s in enumerate([*range(18), *range(15, 30)]):
        world = 3 if i < 18 else 2
        if i == 18:
            log.event(Event("failure", "1 worker(s) lost", step=18, time=t))
            log.event(Event("recovered", "from buddies", step=15, time=t + 0.5))
            t += 0.5
        t += 0.1
        log.metric({"step": s, "loss": 1.0 / (s + 1), "samples_per_s": 100.0 * world,
                    "step_time": 0.1, "world_size": world, "strategy": "zero3", "time": t})
    log.close()
    run = load_run(run_dir)
    assert [m["step"] for m in run.metrics] == list(range(30)) and run.rerun_steps == 3
    assert [m["world_size"] for m in run.metrics[14:18]] == [3, 2, 2, 2]
    files = write_report(run_dir)
    layout = files.layout
    img = _image(files.png)
    a = layout["axes"]["world_size"]
    left, top, right, bottom = a["bbox_px"]
    y0, y1 = a["ylim"]
    world_color = _rgb(layout["colors"]["world_size"])
    for step_x in (16.3, 16.7, 17.5):  # inside steps 16 and 17 (re-run on 2 workers)
        col = int(_expected_x(layout, step_x))
        column = img[int(top):int(bottom), col]
        rows = int(top) + np.flatnonzero((column == world_color).all(axis=1))
        want = bottom - (2 - y0) / (y1 - y0) * (bottom - top)
        assert len(rows) >= 2 and all(abs(r + 0.5 - want) <= 2.0 for r in rows), (step_x, rows)
    page = open(files.html).read()
    assert "steps run again after a recovery" in page


def test_report_over_wall_time(tmp_path):
    run_dir = str(tmp_path / "run")
    _synthetic_run(run_dir)
    out = str(tmp_path / "out")
    files = write_report(run_dir, out, x_axis="time")
    layout = files.layout
    assert layout["x_axis"] == "time"
    img = _image(files.png)
    _check_image_basics(img, layout)
    by_kind = {m["kind"]: m for m in layout["markers"]}
    # the failure happened 1.5 s in (15 steps of 0.1 s); recovery 2 s later
    assert by_kind["failure"]["x"] == pytest.approx(1.5)
    assert by_kind["recovered"]["x"] == pytest.approx(3.5)
    _check_markers(img, layout)


def test_report_errors_are_clear(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        write_report(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError, match="has no metrics.jsonl"):
        write_report(str(empty))
    (empty / "metrics.jsonl").write_text("")
    (empty / "events.jsonl").write_text(json.dumps({"kind": "start", "message": "x"}) + "\n")
    with pytest.raises(ReportError, match="no completed step"):
        write_report(str(empty))
    with pytest.raises(ReportError, match="x axis"):
        write_report(str(empty), x_axis="bogus")
    assert issubclass(ReportError, elastic.ElasticError)
    # the command line: non-zero exit, one clear line on stderr, no traceback
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "elastic: error: run directory" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "nope")
