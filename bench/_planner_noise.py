"""How far ``bench/planner.py``'s measured side agrees with itself, by issue 16's own yardsticks.

The goals hold a prediction to within 10 % (profiled) or 5 % (closed loop) of a measured step,
and auto's pick to within 5 % of the measured fastest. On a shared host the measured figure
moves too; this applies the same yardsticks to two independent measurements of the same
layout in the same run, so a table says which misses the measurement itself would make:

- 2 passes (there and back): pass 1 against pass 2, each one pass (the drift between them not
  cancelled: an upper bound on the noise of the figure the goals are judged against, their pool);
- 4 passes or more (there, back, there, back ...): passes 1 + 4 against 2 + 3 (and so on in
  fours), each half there and back, so each half is a figure measured as a 2-pass run's is:
  the repeatability of the figure the goals were judged against in every 2-pass run.

Each row keeps each pass's step times (``pass_times``); rows of older runs only each pass's
median (``passes``), which serve for 2 passes.
"""

from __future__ import annotations

import statistics
from typing import Any

LAYOUTS = ("dp", "zero1", "zero2", "zero3", "pipeline")


def halves(row: dict[str, Any]) -> tuple[float, float] | None:
    """Two independent figures of one layout (see the module's text), or None where it ran in
    fewer than 2 passes."""
    times = row.get("pass_times")
    n = len(times) if times else len(row.get("passes", ()))
    if n < 2:
        return None
    if n < 4 or not times:
        return row["passes"][0], row["passes"][1]
    a = [t for i, ts in enumerate(times[:n - n % 4]) if i % 4 in (0, 3) for t in ts]
    b = [t for i, ts in enumerate(times[:n - n % 4]) if i % 4 in (1, 2) for t in ts]
    return statistics.median(a), statistics.median(b)


def _kind(n: int) -> str:
    return ("pass 1 against pass 2 (one pass each)" if n < 4 else
            "passes 1 + 4 against 2 + 3 (each there and back, as a 2-pass run's figure)")


def repeatability(results: list[dict[str, Any]]) -> list[str]:
    """One line per kind of run in ``results`` (2 passes; 4 or more): the goals' yardsticks
    applied to one measurement of each layout against the other."""
    groups: dict[str, dict[str, list[float]]] = {}
    for res in results:
        rows = res["rows"]
        pair = {k: halves(rows[k]) for k in LAYOUTS if k in rows}
        pair = {k: v for k, v in pair.items() if v is not None}
        if not pair:
            continue
        n = len(rows[next(iter(pair))].get("pass_times") or rows[next(iter(pair))]["passes"])
        g = groups.setdefault(_kind(n), {"abs": [], "ratio": [], "pick": []})
        g["abs"] += [abs(a / b - 1) for a, b in pair.values()]
        if "dp" in pair:
            (da, db) = pair["dp"]
            g["ratio"] += [abs((a / da) / (b / db) - 1) for k, (a, b) in pair.items()
                           if k != "dp"]
        if len(pair) > 1:  # the fastest by one measurement, judged by the other
            by_a = min(pair, key=lambda k: pair[k][0])
            g["pick"].append(pair[by_a][1] / min(b for _, b in pair.values()))
    lines = []
    own = [abs(res["rows"]["pick"]["measured_s"] / r["measured_s"] - 1) for res in results
           for k, r in res["rows"].items() if k in LAYOUTS
           and r["plan"] == res["rows"]["pick"]["plan"]]
    if own:  # what the closed loop sees (the pick's first 50 steps) of its own layout, later
        lines.append(f"repeatability, the pick's first 50 steps against its own layout in the "
                     f"passes (the closed loop's input, minutes later): within 5 % "
                     f"{sum(e <= 0.05 for e in own)}/{len(own)}, within 10 % "
                     f"{sum(e <= 0.10 for e in own)}/{len(own)} (median "
                     f"{statistics.median(own):.0%})")
    for kind, g in groups.items():
        ab, ra, pk = g["abs"], g["ratio"], g["pick"]
        line = (f"repeatability, {kind}: within 10 % {sum(e <= 0.10 for e in ab)}/{len(ab)} "
                f"layouts, within 5 % {sum(e <= 0.05 for e in ab)}/{len(ab)} (median "
                f"{statistics.median(ab):.0%})")
        if ra:
            line += (f"; as ratios to dp within 10 % {sum(e <= 0.10 for e in ra)}/{len(ra)}, "
                     f"within 5 % {sum(e <= 0.05 for e in ra)}/{len(ra)} (median "
                     f"{statistics.median(ra):.0%})")
        if pk:
            line += (f"; the fastest by one within 5 % of the fastest by the other: "
                     f"{sum(x <= 1.05 for x in pk)}/{len(pk)} configurations")
        lines.append(line)
    return lines
