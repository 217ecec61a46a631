"""The balancer: batch shares by speed, pipeline stage splits by cost, and when to re-balance.

Pure functions on numbers; the planner and the live controller feed them measured speeds
(samples per second per device) and per-block costs. The drift rule returns a decision and
does nothing itself: the controller decides when to apply it (at a step boundary).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .errors import BalanceError

__all__ = ["proportional_shares", "stage_split", "RebalanceDecision", "rebalance_decision",
           "recut_shares", "affine_shares", "position_blocks", "position_work", "resplit_stages"]


def proportional_shares(
    total: int,
    speeds: Sequence[float],
    caps: Sequence[int | None] | None = None,
    min_share: int = 1,
) -> tuple[int, ...]:
    """Split ``total`` samples into integers proportional to ``speeds``.

    Guarantees: the shares sum to ``total`` exactly, each is >= ``min_share`` and <= its cap
    (``caps[i]`` = most samples device i can hold, ``None`` = no cap). Caps are met by
    water-filling (a capped device keeps its cap, the rest is re-split among the others),
    then each quota is rounded down and the samples left go one each to the devices whose
    time with one more sample is shortest (ties to the lower index): the rounding within 1
    of the quotas with the shortest slowest device. Raises ``BalanceError`` when
    ``total`` is too small for ``min_share`` each or the caps cannot hold ``total``.
    """
    n = len(speeds)
    if n == 0:
        raise BalanceError("no devices to share the batch among")
    if any(not (s > 0 and math.isfinite(s)) for s in set(speeds)):
        raise BalanceError(f"speeds must be positive and finite, got {list(speeds)}")
    cap = [math.inf] * n if caps is None else [math.inf if c is None else c for c in caps]
    if len(cap) != n:
        raise BalanceError(f"{len(cap)} caps for {n} devices")
    if total < n * min_share:
        raise BalanceError(
            f"global batch {total} < {n} devices x {min_share} sample(s) each; "
            "use fewer devices or a larger batch"
        )
    if min(cap) < min_share:
        low = [i for i, c in enumerate(cap) if c < min_share]
        raise BalanceError(
            f"devices {low} cannot hold even {min_share} sample(s) "
            "(memory cap); drop them from the plan"
        )
    if sum(cap) < total:
        raise BalanceError(
            f"the devices hold at most {sum(cap):g} samples together, the batch is "
            f"{total}; add devices, use gradient accumulation or shard more"
        )
    if len(set(speeds)) == 1 and len(set(cap)) == 1:
        # Alike devices (a big homogeneous cluster): what the general path below gives,
        # without its O(n log n) Python work: the first total % n get one more.
        base, extra = divmod(total, n)
        return (base + 1,) * extra + (base,) * (n - extra)
    if n >= _GROUPED_FROM:
        grouped = _grouped_shares(total, speeds, cap, min_share)
        if grouped is not None:
            return grouped
    return _each_shares(total, speeds, cap, min_share)


_GROUPED_FROM = 64  # devices from which the shares are worked out per (speed, cap) first


def _each_shares(total: int, speeds: Sequence[float], cap: Sequence[float],
                 min_share: int) -> tuple[int, ...]:
    """``proportional_shares``' general path, device by device (the checks done)."""
    n = len(speeds)
    quota = _clamped_quotas(total, speeds, min_share, cap)
    shares = [max(min_share, int(math.floor(q + 1e-9))) for q in quota]
    while sum(shares) > total:  # float slack in the quotas: take back from the
        i = max((j for j in range(n) if shares[j] > min_share),  # most over its quota
                key=lambda j: (shares[j] - quota[j], -j))
        shares[i] -= 1
    left = total - sum(shares)
    # the samples left over (fewer than the devices) go one each to the devices whose time
    # with one more is shortest: that minimizes the slowest device's time among roundings
    # within 1 of the quotas (largest-remainder rounding does not: 7 over speeds 3, 1, 1 gives
    # it 4, 2, 1, whose slowest device needs 2 where 5, 1, 1 needs 1.67)
    order = sorted(range(n), key=lambda i: ((shares[i] + 1) / speeds[i], i))
    k = 0
    while left > 0:
        i = order[k % n]
        if shares[i] < cap[i]:
            shares[i] += 1
            left -= 1
        k += 1
    return tuple(shares)


def _grouped_shares(total: int, speeds: Sequence[float], cap: Sequence[float],
                    min_share: int) -> tuple[int, ...] | None:
    """``_each_shares``' result worked out once per (speed, cap) value, for devices that take
    few (a cluster of a few pools, a pipeline's replicas of a few classes: 5,000 of them,
    thousands of calls per planner call): the quotas over the values weighted by their
    counts, and the samples left over one each to the devices in the same order (by time
    with one more, ties to the lower index). None where that path's rarer steps are needed
    (rounding slack over the total, a second round of samples left over) or the values are
    many: the caller goes device by device."""
    n = len(speeds)
    keys = list(dict.fromkeys(zip(speeds, cap, strict=True)))  # (C-level passes: n is large)
    if len(keys) * 8 > n:
        return None
    index = {k: c for c, k in enumerate(keys)}
    cls = list(map(index.__getitem__, zip(speeds, cap, strict=True)))
    counts = [cls.count(c) for c in range(len(keys))]

    def members(c: int) -> Iterator[int]:
        return itertools.compress(range(n), map(c.__eq__, cls))

    quota = _clamped_quotas(total, [k[0] for k in keys], min_share, [k[1] for k in keys],
                            counts)
    share = [max(min_share, int(math.floor(q + 1e-9))) for q in quota]
    left = total - sum(s * k for s, k in zip(share, counts, strict=True))
    if left < 0:
        return None
    out = [share[c] for c in cls]
    if not left:
        return tuple(out)
    time = [(share[c] + 1) / keys[c][0] for c in range(len(keys))]
    by_time = sorted(range(len(keys)), key=time.__getitem__)
    for _, same in itertools.groupby(by_time, key=time.__getitem__):
        group = list(same)
        for i in (members(group[0]) if len(group) == 1
                  else heapq.merge(*(members(c) for c in group))):
            if out[i] < cap[i]:
                out[i] += 1
                left -= 1
                if not left:
                    return tuple(out)
    return None


def _clamped_quotas(total: int, speeds: Sequence[float], floor: int,
                    cap: Sequence[float], counts: Sequence[int] | None = None) -> list[float]:
    """``clamp(lam * speed_i, floor, cap_i)`` with the ``lam`` that makes them sum to
    ``total`` (feasible: ``n * floor <= total <= sum(cap)``, checked by the caller). Their sum
    is piecewise linear in ``lam``: device i is at the floor below ``floor / speed_i``, at its
    cap above ``cap_i / speed_i``, ``lam * speed_i`` between; one pass over those breakpoints
    in order finds ``lam`` exactly, O(n log n). (Fixing devices at a bound one after another
    does not: a fast device fixed at its cap, then the others lifted to the floor, summed
    past the total, [8, 4, 4] for 14.) ``counts``: how many devices each entry stands for
    (1 each by default)."""
    k = [1] * len(speeds) if counts is None else counts
    events = sorted([(floor / v, 0, i) for i, v in enumerate(speeds)]
                    + [(c / v, 1, i) for i, (c, v) in enumerate(zip(cap, speeds, strict=True))
                       if math.isfinite(c)])
    const, slope = float(floor * sum(k)), 0.0  # the sum is const + slope * lam
    lam = 0.0
    for at, kind, i in events:
        if const + slope * at >= total:
            lam = (total - const) / slope if slope > 0 else at
            break
        if kind == 0:  # off the floor from here
            const -= floor * k[i]
            slope += speeds[i] * k[i]
        else:  # at its cap from here
            const += cap[i] * k[i]
            slope -= speeds[i] * k[i]
    else:
        lam = (total - const) / slope if slope > 0 else 0.0
    return [min(c, max(floor, lam * v)) for v, c in zip(speeds, cap, strict=True)]


def stage_split(
    block_costs: Sequence[float],
    stage_speeds: Sequence[float],
    *,
    block_memory: Sequence[float] | None = None,
    stage_memory: Sequence[float] | None = None,
) -> tuple[int, ...]:
    """Contiguous blocks per stage minimizing the slowest stage's time, by dynamic programming.

    Stage s takes ``sum(cost of its blocks) / stage_speeds[s]``. With ``block_memory`` and
    ``stage_memory`` a stage may hold only blocks whose memory sums to its budget. Every stage
    gets >= 1 block. O(stages x blocks^2). Raises ``BalanceError`` if no split is feasible.
    Without memory, remembered by its figures (the planner asks the same split again on each
    failure's composition of a big cluster).
    """
    if block_memory is None and stage_memory is None:
        return _split_by_cost(tuple(block_costs), tuple(stage_speeds))
    return _split(block_costs, stage_speeds, block_memory, stage_memory)


@functools.lru_cache(maxsize=4096)
def _split_by_cost(block_costs: tuple[float, ...], stage_speeds: tuple[float, ...]
                   ) -> tuple[int, ...]:
    return _split(block_costs, stage_speeds, None, None)


def _split(block_costs: Sequence[float], stage_speeds: Sequence[float],
           block_memory: Sequence[float] | None, stage_memory: Sequence[float] | None
           ) -> tuple[int, ...]:
    """``stage_split``'s dynamic programme."""
    nb, ns = len(block_costs), len(stage_speeds)
    if ns == 0 or nb < ns:
        raise BalanceError(f"{nb} blocks cannot fill {ns} stages (each needs >= 1 block)")
    if any(s <= 0 for s in stage_speeds):
        raise BalanceError("stage speeds must be positive")
    pre = [0.0]
    for c in block_costs:
        pre.append(pre[-1] + c)
    mpre = [0.0]
    for mb in block_memory or [0.0] * nb:
        mpre.append(mpre[-1] + mb)
    budget = list(stage_memory) if stage_memory is not None else [math.inf] * ns
    inf = math.inf
    # best[s][i]: min over splits of blocks [0, i) into stages 0..s-1 of the max stage time.
    best = [[inf] * (nb + 1) for _ in range(ns + 1)]
    cut = [[0] * (nb + 1) for _ in range(ns + 1)]
    best[0][0] = 0.0
    for s in range(1, ns + 1):
        for i in range(s, nb - (ns - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf or mpre[i] - mpre[j] > budget[s - 1]:
                    continue
                t = max(best[s - 1][j], (pre[i] - pre[j]) / stage_speeds[s - 1])
                if t < best[s][i]:
                    best[s][i], cut[s][i] = t, j
    if best[ns][nb] == inf:
        raise BalanceError("no contiguous split fits the stages' memory; add stages or memory")
    sizes, i = [], nb
    for s in range(ns, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


@dataclass(frozen=True)
class RebalanceDecision:
    """Whether to re-balance, why, and the shares to use if so (``shares`` == current if not)."""

    rebalance: bool
    reason: str
    drift: float
    gain: float
    shares: tuple[int, ...]


def rebalance_decision(
    shares: Sequence[int],
    used_speeds: Sequence[float],
    measured_speeds: Sequence[float],
    *,
    threshold: float = 0.1,
    min_gain: float = 0.05,
    caps: Sequence[int | None] | None = None,
) -> RebalanceDecision:
    """Re-balance when the measured relative speeds drift from the ones the shares were cut for.

    Speeds are compared after normalising each vector to sum 1, so a uniformly slower
    cluster does not trigger. Drift = max_i |measured_i / used_i - 1|. Re-balance only if
    drift > ``threshold`` AND the predicted step (max_i share_i / speed_i) improves by at
    least ``min_gain``. Returns a decision; does not act.
    """
    n = len(shares)
    if not (len(used_speeds) == len(measured_speeds) == n):
        raise BalanceError("shares, used_speeds and measured_speeds must have equal lengths")
    su, sm = sum(used_speeds), sum(measured_speeds)
    drift = max(
        abs((m / sm) / (u / su) - 1.0) for u, m in zip(used_speeds, measured_speeds, strict=True)
    )
    now = tuple(shares)
    if drift <= threshold:
        return RebalanceDecision(
            False,
            f"relative speeds within {threshold:.0%} of the ones used (drift {drift:.1%})",
            drift,
            0.0,
            now,
        )
    new = proportional_shares(sum(shares), measured_speeds, caps)
    t_now = max(s / v for s, v in zip(now, measured_speeds, strict=True))
    t_new = max(s / v for s, v in zip(new, measured_speeds, strict=True))
    gain = 1.0 - t_new / t_now
    if gain < min_gain:
        return RebalanceDecision(
            False,
            f"drift {drift:.1%} but re-balancing would gain only {gain:.1%} (< {min_gain:.0%})",
            drift,
            gain,
            now,
        )
    return RebalanceDecision(
        True,
        f"drift {drift:.1%} > {threshold:.0%}; new shares cut the step by {gain:.1%}",
        drift,
        gain,
        new,
    )


def recut_shares(shares: Sequence[int], seconds_per_sample: Sequence[float],
                 fixed: Sequence[float] = (), caps: Sequence[int | None] | None = None,
                 min_share: int = 1) -> tuple[tuple[int, ...], float]:
    """Shares that follow measured compute seconds per sample of each rank, and the seconds
    per step they save: the slowest rank's compute before minus after. ``fixed``: the part
    of each rank's figure that is fixed per step (passes, launches) spread over its share
    now, as a fraction of it; a rank's compute at ``n`` samples is then that part of its
    step plus ``n`` times the rest (``affine_shares``; none: ``n`` times its figure).
    ``caps``: the most samples each rank holds (its free memory); ``min_share``: the
    fewest (a lockstep strategy's micro-batches). Raises ``BalanceError`` on bad input, or
    caps that cannot hold the batch."""
    if len(shares) != len(seconds_per_sample) or not shares:
        raise BalanceError("one seconds-per-sample figure per share is needed")
    if any(not (c > 0 and math.isfinite(c)) for c in seconds_per_sample):
        raise BalanceError(f"seconds per sample must be positive, got {list(seconds_per_sample)}")
    phi = list(fixed) if len(fixed) == len(shares) else [0.0] * len(shares)
    if any(not 0.0 <= f < 1.0 for f in phi):
        raise BalanceError(f"fixed fractions must be in [0, 1), got {phi}")
    a = [f * c * n for f, c, n in zip(phi, seconds_per_sample, shares, strict=True)]
    b = [(1.0 - f) * c for f, c in zip(phi, seconds_per_sample, strict=True)]
    new = (affine_shares(sum(shares), a, b, min_share, caps) if any(phi)
           else proportional_shares(sum(shares), [1.0 / c for c in seconds_per_sample], caps,
                                    min_share))
    before = max(x + y * n for x, y, n in zip(a, b, shares, strict=True))
    after = max(x + y * n for x, y, n in zip(a, b, new, strict=True))
    return new, before - after


def affine_shares(total: int, fixed: Sequence[float], per_sample: Sequence[float],
                  min_share: int = 1, caps: Sequence[int | None] | None = None
                  ) -> tuple[int, ...]:
    """Integer shares summing to ``total`` (each at least ``min_share`` and at most its cap:
    ``caps[i]``, the most samples device ``i`` holds, None for no cap) that make the
    slowest device's time least, device ``i`` taking ``fixed[i] + n * per_sample[i]`` for
    ``n`` samples: the level where the continuous shares meet ``total`` (bisection), each
    rounded down, the samples left one each to the devices whose time with one more is
    shortest (ties to the lower index), as ``proportional_shares`` rounds. Raises
    ``BalanceError`` when the caps cannot hold ``total``."""
    n = len(per_sample)
    if n == 0 or len(fixed) != n:
        raise BalanceError("one fixed and one per-sample figure per device are needed")
    if total < n * min_share:
        raise BalanceError(f"global batch {total} < {n} devices x {min_share} sample(s) each")
    cap = [math.inf if c is None else c for c in (caps or [None] * n)]
    if min(cap) < min_share or sum(cap) < total:
        raise BalanceError(f"the devices hold at most {sum(cap):g} samples together "
                           f"({min(cap):g} the least), the batch is {total}")
    if len(set(zip(fixed, per_sample, cap, strict=True))) == 1:  # alike: the first total % n
        base, extra = divmod(total, n)  # one more
        return (base + 1,) * extra + (base,) * (n - extra)

    def quota(t: float) -> list[float]:
        return [min(c, max(float(min_share), (t - a) / b))
                for a, b, c in zip(fixed, per_sample, cap, strict=True)]

    lo = min(a + b * min_share for a, b in zip(fixed, per_sample, strict=True))
    hi = max(a + b * total for a, b in zip(fixed, per_sample, strict=True))
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(quota(mid)) < total:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    shares = [int(math.floor(q + 1e-9)) for q in quota(lo)]
    over = sum(shares) - total
    if over > 0:  # (float slack) back from the slowest that can give
        order = sorted((j for j in range(n) if shares[j] > min_share),
                       key=lambda j: (-(fixed[j] + per_sample[j] * shares[j]), j))
        for j in order[:over]:
            shares[j] -= 1
    # the samples left (fewer than the devices: each quota lost under 1) one at a time to
    # the device with room whose time with one more is shortest (one each is not enough: a
    # device of small per-sample time may take two before another takes one)
    heap = [(fixed[j] + per_sample[j] * (shares[j] + 1), j) for j in range(n)
            if shares[j] < cap[j]]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, j = heapq.heappop(heap)
        shares[j] += 1
        if shares[j] < cap[j]:
            heapq.heappush(heap, (fixed[j] + per_sample[j] * (shares[j] + 1), j))
    return tuple(shares)


def position_blocks(split: Sequence[int], pp: int) -> list[list[int]]:
    """The blocks each of ``pp`` pipeline ranks along a replica runs under ``split`` (blocks
    per stage; stage k on position k % pp, as the interleaved schedule places its chunks)."""
    out: list[list[int]] = [[] for _ in range(pp)]
    i = 0
    for k, b in enumerate(split):
        out[k % pp] += range(i, i + b)
        i += b
    return out


def position_work(split: Sequence[int], weights: Sequence[float], pp: int) -> tuple[float, ...]:
    """The work (``weights``, one per block) on each of ``pp`` pipeline positions."""
    return tuple(sum(weights[i] for i in idx) for idx in position_blocks(split, pp))


def resplit_stages(split: Sequence[int], weights: Sequence[float],
                   position_s: Sequence[float]) -> tuple[tuple[int, ...], float]:
    """The stage split that follows the measured compute seconds per sample of each
    pipeline position (``position_s``: its slowest replica's, for its blocks now), with
    per-block ``weights`` to move work by, and the slowest position's seconds per sample
    under it. Each position's speed is its work now over its time; ``stage_split`` cuts the
    blocks to those speeds. The split given (and its slowest figure) when no cut is faster.
    Raises ``BalanceError`` on bad input."""
    pp = len(position_s)
    if not pp or len(split) % pp or sum(split) != len(weights) or any(b < 1 for b in split):
        raise BalanceError(f"stage split {list(split)} does not cover {len(weights)} blocks "
                           f"on {pp} positions")
    if any(not (c > 0 and math.isfinite(c)) for c in position_s):
        raise BalanceError(f"seconds per sample must be positive, got {list(position_s)}")
    work = position_work(split, weights, pp)
    if any(w <= 0 for w in work):
        raise BalanceError("every position needs work of positive weight")
    speed = [w / c for w, c in zip(work, position_s, strict=True)]
    new = stage_split([max(1e-12, w) for w in weights], [speed[k % pp] for k in range(len(split))])
    after = max(w / v for w, v in zip(position_work(new, weights, pp), speed, strict=True))
    before = max(position_s)
    return (tuple(new), after) if after < before else (tuple(split), before)
