"""elastic.report without a job: a step completed while a worker was lost has no speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from elastic.report import write_report  # noqa: E402


def test_a_step_completed_while_a_worker_was_lost_draws_no_speed(tmp_path):
    """metrics.jsonl's placeholder for a step whose metrics were lost with a worker
    (``note``; ``samples_per_s`` 0) is a gap in the speed panel. Was: drawn as 0 samples/s,
    a drop to nothing that never happened (the panel's scale stretched down to 0)."""
    lines = [{"step": s, "loss": 1.0 / (s + 1), "samples_per_s": 1000.0 + s, "step_time": 0.1,
              "world_size": 2, "strategy": "dp", "time": 1e9 + s, "generation": 1}
             for s in range(6)]
    lines[3].update(loss=None, samples_per_s=0.0, step_time=0.0,
                    note="completed while a worker was lost; its loss was not reported")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "events.jsonl").write_text("")
    out = write_report(str(tmp_path))
    lo, hi = out.layout["axes"]["samples_per_s"]["ylim"]
    assert 900 < lo < 1000 < 1005 < hi, (lo, hi)
