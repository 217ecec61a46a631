"""What-ifs over the planner bench's stored runs (``bench/results/planner-*.json.gz``), each
replayed (``planner.replay``: the cost model fitted again from the runs' profile reports, the
measured side as it was), so that a ranking rule is judged on every run at once. No Ray.

- ``dp-first``: auto's picks within 5 % of the fastest, per run, with and without "of the tried
  plans within the trial tolerance, one that keeps every rank's state first"
  (``clusters.planner.break_tie``; without it: ``keeps_state`` answers False).
- ``noise-tolerance``: the same with the trial tolerance max(5 %, k standard errors of the
  trial's zero1/dp ratio on its slowest rank) instead of 5 %, for each k given.
- ``trial-bias``: zero1's (and zero3's) trial ratio to the dp steps beside it against the
  passes' ratio, the mean of log(trial / passes) with its standard error, per family.

    python bench/planner_whatif.py                       # all three, every stored run
    python bench/planner_whatif.py --what dp-first --runs bench/results/planner-*-f-*.json.gz
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import math
import os
import statistics as st
import sys
from collections.abc import Callable
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]

import planner as P  # noqa: E402


def _rel_se(xs: list[float]) -> float:
    """The relative standard error of a median (MAD-scaled, 1.2533 sd / sqrt(n))."""
    m = st.median(xs)
    return 1.2533 * 1.4826 * st.median([abs(x - m) for x in xs]) / m / math.sqrt(len(xs))


def _trials(res: dict[str, Any], key: str) -> list[tuple[list[float], list[float]]]:
    """Each rank's trial of ``key`` (``trial_zero1``, ``trial_zero3``): (its steps, the dp
    steps beside them)."""
    return [(t["seconds"], t["dp_seconds"]) for r in res["profile"]["reports"]
            if (t := r.get(key) or {}).get("seconds") and t.get("dp_seconds")]


def _trial_se(res: dict[str, Any]) -> float:
    """The standard error of zero1's trial ratio to dp, on the rank where it is largest."""
    return max((math.hypot(_rel_se(a), _rel_se(b)) for a, b in _trials(res, "trial_zero1")),
               default=0.0)


def _picks(runs: list[tuple[str, dict[str, Any]]],
           tolerance: Callable[[dict[str, Any]], float] | None = None) -> dict[str, list[int]]:
    """Per run, [picks within 5 % of the fastest, configurations judged], replayed (with the
    trial tolerance ``tolerance(result)`` where given)."""
    out: dict[str, list[int]] = {}
    for run, res in runs:
        options = {} if tolerance is None else {"trial_tolerance": tolerance(res)}
        with contextlib.redirect_stdout(io.StringIO()):
            new = P.replay([res], **options)
        if not new or new[0]["pick_over_fastest"] is None:
            continue
        tally = out.setdefault(run, [0, 0])
        tally[0] += new[0]["pick_over_fastest"] <= 1.05
        tally[1] += 1
    return out


def _show(what: str, tally: dict[str, list[int]]) -> None:
    ok, n = (sum(v[i] for v in tally.values()) for i in (0, 1))
    print(f"{what}: {ok}/{n} picks within 5 % ("
          + ", ".join(f"{run} {a}/{b}" for run, (a, b) in tally.items()) + ")")


def dp_first(runs: list[tuple[str, dict[str, Any]]]) -> None:
    import clusters.planner as cp

    # (no option of the planner's turns the rule off: its module's keeps_state is replaced,
    # which break_tie reads at each call)
    _show("with dp first", _picks(runs))
    real = cp.keeps_state
    cp.keeps_state = lambda plan: False  # type: ignore[assignment]
    try:
        _show("without", _picks(runs))
    finally:
        cp.keeps_state = real


def noise_tolerance(runs: list[tuple[str, dict[str, Any]]], ks: list[float]) -> None:
    _show("trial tolerance 5 %", _picks(runs))
    for k in ks:
        _show(f"max(5 %, {k:g} standard errors)",
              _picks(runs, lambda res, k=k: max(0.05, k * _trial_se(res))))


def trial_bias(runs: list[tuple[str, dict[str, Any]]]) -> None:
    for key, layout in (("trial_zero1", "zero1"), ("trial_zero3", "zero3")):
        logs: dict[str, list[float]] = {}
        for _, res in runs:
            rows = res["rows"]
            ratios = [st.median(a) / st.median(b) for a, b in _trials(res, key)]
            if ratios and layout in rows and "dp" in rows:
                passes = rows[layout]["measured_s"] / rows["dp"]["measured_s"]
                logs.setdefault(res["family"], []).append(math.log(max(ratios) / passes))
        every = [x for xs in logs.values() for x in xs]
        if len(every) < 2:
            continue
        print(f"{layout}: log(trial / passes) over {len(every)} configurations: mean "
              f"{st.mean(every):+.3f} (standard error {st.stdev(every) / math.sqrt(len(every)):.3f}),"
              f" lower in {sum(x < 0 for x in every)}; by family "
              + ", ".join(f"{f} {st.mean(xs):+.2f} ({len(xs)})" for f, xs in sorted(logs.items())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+",
                    default=sorted(glob.glob(os.path.join(BENCH, "results", "planner-*.json.gz"))))
    ap.add_argument("--what", nargs="+", default=["dp-first", "noise-tolerance", "trial-bias"],
                    choices=["dp-first", "noise-tolerance", "trial-bias"])
    ap.add_argument("--k", nargs="+", type=float, default=[1.0, 1.5, 2.0])
    args = ap.parse_args(argv)
    runs = [(os.path.basename(path), res) for path in args.runs
            for res in P._load(path)["results"] if res.get("profile")]
    if "dp-first" in args.what:
        dp_first(runs)
    if "noise-tolerance" in args.what:
        noise_tolerance(runs, args.k)
    if "trial-bias" in args.what:
        trial_bias(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
