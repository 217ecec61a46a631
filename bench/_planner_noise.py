"""How far ``bench/planner.py``'s measured side agrees with itself, by issue 16's own yardsticks.

The goals hold a prediction to within 10 % (profiled) or 5 % (closed loop) of a measured step,
and auto's pick to within 5 % of the measured fastest. On a shared host the measured figure
moves too; this applies the same yardsticks to two independent measurements of the same
layout in the same run, so a table says which misses the measurement itself would make:

- 2 passes (there and back): pass 1 against pass 2, each one pass (the drift between them not
  cancelled: an upper bound on the noise of the figure the goals are judged against, their pool);
- 4 passes (there, back, there, back): passes 1 + 4 against 2 + 3, so that a steady drift
  cancels in each half, and each half is a figure made of two passes as a 2-pass run's is.
  (At the turns no switch runs: dp's passes 2 and 3, and the pipeline's 1 and 2 and 3 and 4,
  are back to back, each still counted after its warm-up steps.)

Each row keeps each pass's step times (``pass_times``); rows of older runs only each pass's
median (``passes``), which serve for 2 passes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

LAYOUTS = ("dp", "zero1", "zero2", "zero3", "pipeline")
PASSES = (1, 2, 4)  # --passes


def pass_order(passes: int) -> list[str]:
    """The layouts in the order the passes run them: there, back, there, back... (1: there,
    then dp again)."""
    if passes == 1:
        return [*LAYOUTS, "dp-again"]
    return [n for p in range(passes) for n in (LAYOUTS if p % 2 == 0 else LAYOUTS[::-1])]


def passes_row(rows: dict[str, Any], plan: str) -> dict[str, Any] | None:
    """The passes' row of ``plan`` (never the pick's first 50 steps), or None where the passes
    did not run it."""
    return next((r for k, r in rows.items() if k in LAYOUTS and r["plan"] == plan), None)


def halves(row: dict[str, Any]) -> tuple[float, float] | None:
    """Two independent figures of one layout (see the module's text), or None where it ran in
    fewer than 2 passes."""
    times = row.get("pass_times")
    n = len(times) if times else len(row.get("passes", ()))
    if n < 2:
        return None
    if n != 4 or not times:
        return row["passes"][0], row["passes"][1]
    return (statistics.median([*times[0], *times[3]]),
            statistics.median([*times[1], *times[2]]))


def _kind(n: int) -> str:
    return ("pass 1 against pass 2 (one pass each)" if n != 4 else
            "passes 1 + 4 against 2 + 3 (each a 2-pass figure)")


def _within(errs: Sequence[float], *pcts: int) -> str:
    return ", ".join(f"within {p} % {sum(e <= p / 100 for e in errs)}/{len(errs)}"
                     for p in pcts) + f" (median {statistics.median(errs):.0%})"


def repeatability(results: list[dict[str, Any]]) -> list[str]:
    """The goals' yardsticks applied to one measurement of each layout against the other: one
    line per kind of run in ``results`` (2 passes; 4), and one for the pick's first 50 steps
    against its own layout in the passes (the closed loop's input)."""
    groups: dict[str, dict[str, list[float]]] = {}
    own: list[float] = []
    for res in results:
        rows = res["rows"]
        mine = passes_row(rows, rows["pick"]["plan"])
        if mine is not None:
            own.append(abs(rows["pick"]["measured_s"] / mine["measured_s"] - 1))
        pair = {k: h for k in LAYOUTS if k in rows and (h := halves(rows[k])) is not None}
        if not pair:
            continue
        first = rows[next(iter(pair))]
        g = groups.setdefault(_kind(len(first.get("pass_times") or first["passes"])),
                              {"abs": [], "ratio": [], "pick": []})
        g["abs"] += [abs(a / b - 1) for a, b in pair.values()]
        if "dp" in pair:
            da, db = pair["dp"]
            g["ratio"] += [abs((a / da) / (b / db) - 1) for k, (a, b) in pair.items()
                           if k != "dp"]
        if len(pair) > 1:  # the fastest by one measurement, judged by the other
            by_a = min(pair, key=lambda k: pair[k][0])
            g["pick"].append(pair[by_a][1] / min(b for _, b in pair.values()))
    lines = []
    if own:  # (where the pick is dp, the passes begin with dp right after those steps)
        lines.append("repeatability, the pick's first 50 steps against its own layout's figure "
                     f"in the passes (the closed loop's input): {_within(own, 5, 10)}")
    for kind, g in groups.items():
        line = f"repeatability, {kind}: {_within(g['abs'], 10, 5)} of the layouts"
        if g["ratio"]:
            line += f"; as ratios to dp {_within(g['ratio'], 10, 5)}"
        if g["pick"]:
            line += (f"; the fastest by one within 5 % of the fastest by the other: "
                     f"{sum(x <= 1.05 for x in g['pick'])}/{len(g['pick'])} configurations")
        lines.append(line)
    return lines
