"""Repeated timings reduced to a median and a spread, and the small numeric helpers the
profiler's fits share (``clusters.measured``, ``clusters.pipeline_fit``). Pure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ClustersError

__all__ = ["Spread", "robust", "phase_drift", "moved", "bisect_below", "dp_level", "LEVEL_RANGE"]

_MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class Spread:
    """A repeated measurement: ``median``, ``sd`` (1.4826 x median absolute deviation, a
    standard deviation robust to outliers), ``n`` repeats; ``se`` the standard error of the
    median (1.2533 sd / sqrt(n)); ``rel`` = sd / median."""

    median: float
    sd: float
    n: int

    @property
    def se(self) -> float:
        return 1.2533 * self.sd / math.sqrt(self.n) if self.n else math.inf

    @property
    def rel(self) -> float:
        return self.sd / self.median if self.median > 0 else math.inf

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "sd": self.sd, "n": self.n, "rel": self.rel}


def robust(xs: Sequence[float]) -> Spread:
    """Median and robust spread of ``xs``. Raises ``ClustersError`` when empty."""
    if not xs:
        raise ClustersError("no measurement to summarise")
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return Spread(med, _MAD_TO_SD * mad, len(xs))




def phase_drift(xs: Sequence[float], least: int) -> float:
    """How far a run of step times moved between its two halves beyond their noise: the
    difference of the halves' medians less two standard errors of it, over the run's median
    (0 with halves under ``least`` steps). Steps of one layout on a shared host move together
    for tens of steps (1.3-2x here: ``LEVEL_RANGE``); a figure measured in another such phase
    differs by that much, which no standard error of either window shows."""
    n = len(xs) // 2
    if n < max(1, least):
        return 0.0
    run = list(xs)[len(xs) - 2 * n:]
    return moved(robust(run[:n]), robust(run[n:]), statistics.median(run))


def moved(a: Spread, b: Spread, base: float | None = None) -> float:
    """How far figure ``b`` lies from ``a`` beyond two standard errors of their difference,
    relative to ``base`` (``a``'s median by default); 0 within the noise."""
    ref = a.median if base is None else base
    if not ref > 0 or not (math.isfinite(a.se) and math.isfinite(b.se)):
        return 0.0
    return max(0.0, abs(b.median - a.median) - 2 * math.hypot(a.se, b.se)) / ref


def bisect_below(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The largest x in [lo, hi] found with f(x) < target, for f that grows with x (50
    halvings: hi - lo over 1e15)."""
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return lo


LEVEL_RANGE = (1 / 3, 3.0)  # a host's slow phases seen here: 1.3-2x


def dp_level(dp_trial: Spread, beside: Any) -> float:
    """The factor that takes a trial run in rotation with dp's steps (``beside``: those dp
    steps' seconds) to the dp trial's level (``dp_trial``: its steps with every dp step
    beside the trials, ``clusters.measured``), which the model's step overhead was fitted
    to: a slow phase of a shared host falls on a layout and the dp steps beside
    it alike (1.3-2x for 10-40 steps on the 2-core CI VM), and the layout is then predicted
    at the level of the dp trial, not of its own moment. 1 without such steps, or where the
    two dp medians differ by less than 2 standard errors (a correction within the noise of
    a few steps would only add theirs: dlrm's 15 ms steps, sd 20-30 %, moved zero3 by 31 %);
    within ``LEVEL_RANGE``."""
    try:
        here = robust([float(t) for t in beside])
    except (TypeError, ValueError, ClustersError):
        return 1.0
    if not here.median > 0 or not dp_trial.median > 0:
        return 1.0
    if abs(dp_trial.median - here.median) <= 2 * math.hypot(dp_trial.se, here.se):
        return 1.0
    return min(LEVEL_RANGE[1], max(LEVEL_RANGE[0], dp_trial.median / here.median))
