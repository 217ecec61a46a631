"""The planner bench's own arithmetic (``bench/planner.py``, ``bench/_planner_noise.py``): how
far its measurement agrees with itself, and where a closed-loop job settled against the
fastest. A benchmark's figures are not tested; what it computes from them is. No Ray."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import strategies  # noqa: E402,F401 - the package, before bench/strategies.py could shadow it

_PATH = list(sys.path)
sys.path.insert(0, BENCH)
try:  # (bench/ is no package; planner.py puts itself on the path, and bench/strategies.py
    # must not shadow the strategies package for the tests after this one)
    import _planner_noise as noise
    import planner
finally:
    sys.path[:] = _PATH


def _row(plan: str, measured: float, passes: list[list[float]]) -> dict:
    return {"plan": plan, "measured_s": measured, "pass_times": passes,
            "passes": [sorted(p)[len(p) // 2] for p in passes]}


def test_the_passes_go_there_and_back():
    there = list(noise.LAYOUTS)
    assert noise.pass_order(2) == there + there[::-1]
    assert noise.pass_order(4) == (there + there[::-1]) * 2
    assert noise.pass_order(1) == there + ["dp-again"]
    assert set(noise.PASSES) == {1, 2, 4}


def test_four_passes_split_into_there_and_back_halves():
    # passes 1 + 4 and 2 + 3: each half there and back, so a drift over the run cancels
    row = _row("dp", 1.0, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    assert noise.halves(row) == (1.0, 2.0)
    two = _row("dp", 1.0, [[1.0, 1.1, 1.2], [3.0, 3.0, 3.0]])
    assert noise.halves(two) == (1.1, 3.0)  # one pass against the other
    assert noise.halves(_row("dp", 1.0, [[1.0]])) is None
    assert noise.halves({"plan": "dp", "measured_s": 1.0, "passes": [1.0, 1.2]}) == (1.0, 1.2)


def test_repeatability_applies_the_goals_yardsticks_to_the_halves():
    def four(a: float, b: float) -> list[list[float]]:  # halves a (passes 1, 4) and b
        return [[a] * 3, [b] * 3, [b] * 3, [a] * 3]

    rows = {"pick": _row("zero1", 1.0, [[1.0] * 3]),
            # 8 % apart between the halves (within 10 %, not 5 %)
            "dp": {**_row("dp", 1.2, four(1.0, 1.08))},
            # 3 % apart; as a ratio to dp 1.0 against 1.03 / 1.08: 4.9 %
            "zero1": _row("zero1", 1.0, four(1.0, 1.03)),
            # 25 % apart, the fastest by the first half (0.9) but not by the second (1.2,
            # against zero1's 1.03); as a ratio to dp 0.9 against 1.2 / 1.08: 19 %
            "zero2": _row("zero2", 0.9, four(0.9, 1.2))}
    lines = noise.repeatability([{"rows": rows}])
    assert len(lines) == 2
    own, halves = lines
    # the pick (zero1, 1.0) against zero1's figure (1.0), not dp's (1.2)
    assert "first 50 steps" in own and "within 5 % 1/1, within 10 % 1/1" in own
    assert "passes 1 + 4 against 2 + 3" in halves
    assert "within 10 % 2/3, within 5 % 1/3 (median 7%) of the layouts" in halves
    assert "as ratios to dp within 10 % 1/2, within 5 % 1/2" in halves
    assert "the fastest by one within 5 % of the fastest by the other: 0/1" in halves


def test_a_loop_job_that_settled_on_the_fastest_is_at_one():
    # the pick's first 50 steps (0.9) must not stand for the fastest plan's passes (1.0)
    rows = {"pick": {"plan": "dp", "measured_s": 0.9},
            "dp": {"plan": "dp", "measured_s": 1.0},
            "zero1": {"plan": "zero1", "measured_s": 1.1}}
    res = {"rows": rows, "fastest": "dp", "loop": {"final": "dp"}}
    assert planner._settled(res) == pytest.approx(1.0)
    res["loop"] = {"final": "zero1"}
    assert planner._settled(res) == pytest.approx(1.1)
    res["loop"] = {"final": "pp2 1f1b m=2"}  # a plan the passes did not run
    assert planner._settled(res) is None
