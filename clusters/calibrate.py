"""Calibration: fit the cost model's compute and alpha-beta constants to measured steps.

Each ``Measurement`` is one device's view of one step: it processed ``samples`` samples and
the step took ``step_time`` seconds, including one collective of ``comm_bytes`` over
``world_size`` ranks on link ``link``. The model is linear in its unknowns::

    step_time = c[device] * samples + alpha[link] * L(n) + beta[link] * V(n, S) (+ overhead)

with L, V the collective's latency hops and volume (``collectives.latency_hops`` and
``volume_factor``; all_reduce: 2 min(n-1, ceil(log2 n)) and 2(n-1)/n S). ``calibrate`` solves it by least squares with non-negativity (an active set:
a negative unknown is pinned to 0 and the rest refitted); columns that never vary (no
collective measured, say) keep the base model's values. The live system measures, per step
and rank: its samples, its compute time (before the collective) and the step time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .collectives import KINDS, latency_hops, volume_factor
from .cost import CostModel
from .errors import ClustersError

__all__ = ["Measurement", "calibrate"]

_LAT = {k: functools.partial(latency_hops, k) for k in KINDS}
_VOL = {k: functools.partial(volume_factor, k) for k in KINDS}


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured step on one device. ``device``: id or type name (``seconds_per_sample`` key).

    For a compute-only figure (time before the collective) leave ``comm_bytes`` at 0.
    ``messages``: how many messages of ``collective`` carried those ``comm_bytes`` (each pays
    the latency; ``collectives.layout_messages`` says how many a layout sends).
    """

    device: str
    samples: int
    step_time: float
    world_size: int = 1
    comm_bytes: float = 0.0
    collective: str = "all_reduce"
    link: str = "*"
    messages: int = 1


def _solve(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares by normal equations on max-abs-scaled columns; singular -> 0."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[r[j] / scale[j] for j in range(k)] for r in rows]
    m = [
        [sum(r[i] * r[j] for r in a) for j in range(k)]
        + [sum(r[i] * t for r, t in zip(a, y, strict=True))]
        for i in range(k)
    ]
    for c in range(k):
        piv = max(range(c, k), key=lambda i: abs(m[i][c]))
        if abs(m[piv][c]) < 1e-12:
            continue
        m[c], m[piv] = m[piv], m[c]
        for i in range(k):
            if i != c and m[i][c]:
                f = m[i][c] / m[c][c]
                m[i] = [x - f * z for x, z in zip(m[i], m[c], strict=True)]
    return [(m[j][k] / m[j][j] if abs(m[j][j]) >= 1e-12 else 0.0) / scale[j] for j in range(k)]


def calibrate(
    measurements: Sequence[Measurement],
    base: CostModel | None = None,
    *,
    fit_overhead: bool = False,
) -> CostModel:
    """A ``CostModel`` whose ``seconds_per_sample`` and ``links`` fit ``measurements``.

    Keys: ``seconds_per_sample[m.device]`` and ``links[m.link] = (alpha, beta)``. Raises
    ``ClustersError`` when there are no measurements or a figure is not positive.
    """
    base = base or CostModel()
    if not measurements:
        raise ClustersError("calibrate needs at least one measurement")
    for m in measurements:
        if (m.samples < 0 or m.step_time <= 0 or m.world_size < 1 or m.collective not in _LAT
                or m.messages < 1):
            raise ClustersError(
                f"bad measurement {m}: samples >= 0, step_time > 0, "
                f"world_size >= 1, messages >= 1, collective in {sorted(_LAT)}"
            )
    devices = sorted({m.device for m in measurements if m.samples > 0})
    links = sorted({m.link for m in measurements if m.comm_bytes > 0 and m.world_size > 1})
    names = [("c", d) for d in devices] + [(p, lk) for lk in links for p in ("alpha", "beta")]
    if fit_overhead:
        names.append(("o", ""))
    rows, y = [], []
    for m in measurements:
        r = []
        for kind, key in names:
            comm = m.comm_bytes > 0 and m.world_size > 1 and m.link == key
            if kind == "c":
                r.append(float(m.samples) if m.device == key else 0.0)
            elif kind == "alpha":
                r.append(float(m.messages * _LAT[m.collective](m.world_size)) if comm else 0.0)
            elif kind == "beta":
                r.append(_VOL[m.collective](m.world_size) * m.comm_bytes if comm else 0.0)
            else:
                r.append(1.0)
        rows.append(r)
        y.append(m.step_time)
    active = [j for j in range(len(names)) if any(r[j] for r in rows)]
    while True:
        sol = _solve([[r[j] for j in active] for r in rows], y)
        neg = [j for j, v in zip(active, sol, strict=True) if v < 0]
        if not neg:
            break
        active = [j for j in active if j not in neg]
    x = dict.fromkeys(range(len(names)), 0.0)
    x.update(zip(active, sol, strict=True))
    sps = dict(base.seconds_per_sample)
    fitted_links = dict(base.links)
    for j, (kind, key) in enumerate(names):
        if kind == "c" and j in active:
            sps[key] = x[j]
    for lk in links:
        ia, ib = names.index(("alpha", lk)), names.index(("beta", lk))
        fitted_links[lk] = (x[ia], x[ib])
    overhead = x[len(names) - 1] if fit_overhead else base.step_overhead
    return replace(base, seconds_per_sample=sps, links=fitted_links, step_overhead=overhead)
