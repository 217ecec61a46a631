"""Each rank's compute as the closed loop reads it (``clusters.refit``): the live figures
on the model's scale (``LiveScale``), what the model holds fixed per pass beside each rank's
work (``fixed_per_sample``), a device's slowdown in each (``fit_compute``, ``slowdowns``),
and a pipeline's ranks on one footing (``StageBaseline``) with what a straggler carries into
the next layout (``slowness``, ``carried``). Pure: no clock, no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from .balance import position_blocks
from .collectives import SYNC_MODES
from .cost import CostModel, _work_fraction
from .measured import Spread, equal_within_noise
from .plan import Plan
from .profile import ModelProfile
from .replan_policy import peer_median
from .topology import Cluster

__all__ = ["RankPoint", "rank_points", "whole_figures", "moved", "slowdowns", "fit_compute", "LiveScale",
           "fixed_per_sample", "fixed_fractions", "rank_blocks", "stage_fractions",
           "StageBaseline", "peer_ratios", "slowness", "carried"]


@dataclass(frozen=True)
class RankPoint:
    """One window of one device's compute on the model's scale, per step at the layout it
    ran: what the model holds fixed per pass there (``fixed_s``, ``fixed_per_sample``), its
    work (``work_s``) and what was measured (``measured_s``); a pipeline rank's on the
    whole model's scale (over its ``stage_fractions``)."""

    fixed_s: float
    work_s: float
    measured_s: float


def rank_points(plan: Plan, model: CostModel, profile: ModelProfile, cluster: Cluster,
                whole: Sequence[float], fixed: Sequence[float] = ()) -> dict[str, RankPoint]:
    """Each device's ``RankPoint`` at ``plan`` from its measured whole-model seconds per
    sample (``whole``, on the model's scale); ``fixed``: ``fixed_per_sample``'s, where the
    caller has them."""
    fixed = fixed or fixed_per_sample(plan, model, profile, cluster)
    out = {}
    for r, dev in enumerate(plan.devices):
        n = plan.samples(r)
        out[dev] = RankPoint(fixed[r] * n, model.sample_time(cluster.device(dev), profile) * n,
                             whole[r] * n)
    return out


def whole_figures(plan: Plan, profile: ModelProfile, cluster: Cluster,
                  rank_s: Sequence[float], stage_s: Sequence[float] = ()
                  ) -> list[float] | None:
    """Each rank's measured seconds per sample on the whole model's scale: a share-balanced
    layout's ``rank_s``, a pipeline's ``stage_s`` (its stages' blocks) over its
    ``stage_fractions``; None where the window has no figure for every rank."""
    n = len(plan.devices)
    if plan.is_pipeline:
        if len(stage_s) != n or len(rank_s) != n:
            return None
        return [t / f for t, f in zip(stage_s, stage_fractions(plan, profile, cluster),
                                      strict=True)]
    return list(rank_s) if plan.strategy in SYNC_MODES and len(rank_s) == n else None


def moved(before: RankPoint | None, now: RankPoint | None, bar: float = 0.2) -> bool:
    """Whether a device's compute at one layout moved by more than ``bar`` (relative)
    between two of its windows there: it changed (a straggler that slowed further or
    recovered), and what was measured before it is of another device."""
    if before is None or now is None or before.measured_s <= 0:
        return False
    return abs(now.measured_s / before.measured_s - 1.0) > bar


def slowdowns(points: Sequence[RankPoint], spread: float = 0.15, fits: float = 0.1
              ) -> tuple[float, float] | None:
    """How many times its model a device runs in its fixed costs and in its work, fitted to
    ``points`` (least squares on relative errors). None where they cannot tell the two
    apart: fewer than two points, or their fixed costs' parts of the model's figure less
    than ``spread`` apart (a fixed part of 5 ms beside 32-61 ms of work, 1 % noise, gave a
    factor of 0.66-1.36 on it), or a fit at or below 0 on either, or one that misses a point
    by more than ``fits`` (relative, twice a window median's spread on a shared host: the
    device changed between them)."""
    pts = [p for p in points if p.measured_s > 0 and p.work_s > 0 and p.fixed_s > 0]
    parts = [p.fixed_s / (p.fixed_s + p.work_s) for p in pts]
    if len(pts) < 2 or max(parts) - min(parts) < spread:
        return None
    sff = sfw = sww = sfm = swm = 0.0
    for p in pts:
        f, w = p.fixed_s / p.measured_s, p.work_s / p.measured_s
        sff, sfw, sww, sfm, swm = sff + f * f, sfw + f * w, sww + w * w, sfm + f, swm + w
    det = sff * sww - sfw * sfw
    if det <= 1e-12 * sff * sww:
        return None
    ka, kb = (sww * sfm - sfw * swm) / det, (sff * swm - sfw * sfm) / det
    if ka <= 0 or kb <= 0 or any(abs(ka * p.fixed_s + kb * p.work_s - p.measured_s)
                                 > fits * p.measured_s for p in pts):
        return None
    return ka, kb


def fit_compute(model: CostModel, profile: ModelProfile, cluster: Cluster,
                compute: Mapping[str, Spread] | None, kinds: Mapping[str, object] | None = None,
                fixed: Mapping[str, float] | None = None,
                points: Mapping[str, Sequence[RankPoint]] | None = None,
                stragglers: Collection[str] = ()) -> CostModel:
    """``model`` with each device's compute (``compute``: its seconds per sample now) as
    measured. ``fixed``: what of each device's figure the model holds fixed per pass
    (``fixed_per_sample``; without it a figure is taken as work per sample): its figure
    over the model's (that and its work per sample) is how much slower it runs than
    profiled, in both (a rank 6x slower given 1 sample of 64 measured 10 ms/sample, given
    32 0.9: taken as work per sample, the re-cut's step was predicted 7 ms short). Those
    factors, not the figures (which hold the fixed costs over unequal shares), are made
    equal within the noise for devices of one kind. ``stragglers``: the devices whose
    ``points`` (their windows at the layouts since, this one's last) may tell their fixed
    costs' and their work's slowdowns apart (``slowdowns``: an emulated 6x straggler
    measured 6.2x in its work and 10.7x in its fixed costs)."""
    if not compute:
        return model
    ids = sorted(compute)
    sps = dict(model.seconds_per_sample)
    if not fixed:  # the figures as work per sample
        raw = [1.0 / compute[i].median for i in ids]
        spreads = [Spread(r, compute[i].sd * r * r, compute[i].n) for i, r in zip(ids, raw,
                                                                                   strict=True)]
        speeds = equal_within_noise(raw, spreads, [kinds.get(i) for i in ids] if kinds else None)
        sps.update({i: 1.0 / v for i, v in zip(ids, speeds, strict=True)})
        return replace(model, seconds_per_sample=sps)
    own = {i: model.sample_time(cluster.device(i), profile) for i in ids}
    have = {i: own[i] + fixed.get(i, 0.0) for i in ids}
    inv = [have[i] / compute[i].median for i in ids]  # 1 / each device's slowdown
    spreads = [Spread(v, compute[i].sd * v / compute[i].median, compute[i].n)
               for i, v in zip(ids, inv, strict=True)]
    ks = [1.0 / v for v in equal_within_noise(inv, spreads, [kinds.get(i) for i in ids]
                                              if kinds else None)]
    scale = dict(model.pass_scale)
    for i, k in zip(ids, ks, strict=True):
        both = slowdowns((points or {}).get(i, ())) if i in stragglers else None
        ka, kb = both if both is not None else (k, k)
        sps[i] = kb * own[i]
        scale[i] = ka * model.pass_scale.get(i, 1.0)
    return replace(model, seconds_per_sample=sps, pass_scale=scale)


class LiveScale:
    """What takes a layout's live per-rank compute to the model's scale, fixed at the first
    window of each layout on each set of devices (``key``): the model's seconds per sample
    summed over those devices over the window's. The live figure (the seconds inside a
    rank's blocks' forwards over the profile's forward fraction, timed with autograd on and
    the loss outside) is not on the model's scale, whose compute was fitted to the trial
    steps: on a small GPT on 3 CPU ranks it came out 2.1x the model's on every rank, and the
    re-fit's overhead went to -27 ms to meet the step (every layout's compute doubled, every
    step 27 ms shorter). Fixed once, not per window, so that a rank that slows later (a
    straggler) or a host that slows as a whole still shows in the compute as it is; the
    window it is fixed at stands for the profile, which ran just before the job's first
    layout (a layout switched to later is taken at its own first window: zero3's forwards
    hold its gathers, dp's do not). 1 where the model has no per-device figure (profiled by
    device type, as the simulator's clusters are) or a window has none."""

    def __init__(self) -> None:
        self._factor: dict[object, float] = {}
        self._apart: dict[object, dict[int, float]] = {}

    def apart(self, key: object) -> dict[int, float]:
        """The ranks the factor of ``key`` left out, each with its figure against the model
        over the others' median (how much slower it already ran): given once, at the
        layout's first decision (a pipeline's footing takes it out, ``StageBaseline``'s
        ``known``: a rank already slow at a pipeline's start read as its stage's norm)."""
        return self._apart.pop(key, {})

    def __call__(self, key: object, rank_s: Sequence[float], ids: Sequence[str],
                 model: CostModel, fixed: Sequence[float] = (),
                 groups: Sequence[object] = ()) -> tuple[float, ...]:
        return tuple(t * self.factor(key, rank_s, ids, model, fixed, groups) for t in rank_s)

    def factor(self, key: object, rank_s: Sequence[float], ids: Sequence[str],
               model: CostModel, fixed: Sequence[float] = (),
               groups: Sequence[object] = ()) -> float:
        """The factor itself (``rank_s``: whole-model figures; a pipeline's per
        ``stage_fractions``), onto the model's figure per sample at the layout: its work and
        its ``fixed`` costs per sample (``fixed_per_sample``; none: 0). A rank that reads
        more than 10 % slower against the model than the median of its peers (the ranks of
        its ``groups`` entry: a pipeline's replicas of one stage, whose blocks are the same;
        none: every rank) does not count: a straggler (a layout switched to after a rank
        slowed, or whose first window saw it slow: its peers' compute was taken 0.57x, and
        dp was predicted at 1.5 ms against its 16 ms). Against ranks of other stages the bar
        is 50 %: their figures over the model's differ by the blocks' weights' errors (10-20
        %), not by a straggler's (a pipeline entered with an unnamed 6x straggler took a
        scale that put zero2 at 5.6 ms against its 23.3)."""
        if key not in self._factor:
            n = len(ids)
            f = list(fixed) if len(fixed) == n else [0.0] * n
            g = list(groups) if len(groups) == n else [0] * n
            have = [model.seconds_per_sample.get(i, 0.0) for i in ids]
            ok = len(have) == len(rank_s) > 0 and all(h > 0 for h in have) and sum(rank_s) > 0
            if ok:
                have = [h + x for h, x in zip(have, f, strict=True)]
                q = [t / h for t, h in zip(rank_s, have, strict=True)]

                def fast(r: int) -> bool:
                    peers = [q[j] for j in range(n) if j != r and g[j] == g[r]]
                    others = [q[j] for j in range(n) if g[j] != g[r]]
                    return ((not peers or q[r] <= 1.1 * statistics.median(peers))
                            and (not others or q[r] <= 1.5 * statistics.median(others)))

                keep = [r for r in range(n) if q[r] > 0 and fast(r)]
                keep = keep or [r for r in range(n) if q[r] > 0]
                mid = statistics.median(q[r] for r in keep)
                if len(set(g)) > 1:  # (a pipeline's: what its footing takes out)
                    self._apart[key] = {r: q[r] / mid for r in range(n)
                                        if r not in keep and q[r] > 0 and mid > 0}
                self._factor[key] = (sum(have[r] for r in keep)
                                     / sum(rank_s[r] for r in keep))
            else:
                self._factor[key] = 1.0
        return self._factor[key]


def fixed_per_sample(plan: Plan, model: CostModel, profile: ModelProfile, cluster: Cluster
                     ) -> tuple[float, ...]:
    """Per rank of ``plan``, the model's fixed seconds per pass (``CostModel.pass_time`` per
    block, once per micro-batch) spread over the samples through its blocks in a step, on
    the whole model's scale (a pipeline rank's over its ``stage_fractions``): what a rank's
    live compute per sample holds beside its work per sample."""
    fr = stage_fractions(plan, profile, cluster)
    out = []
    for r, dev in enumerate(plan.devices):
        idx = rank_blocks(plan, r)
        blocks = profile.n_blocks if idx is None else len(idx)
        n = plan.samples(r)
        passes = plan.micro_batches * blocks * model.pass_time(cluster.device(dev))
        out.append(passes / n / fr[r] if n > 0 and fr[r] > 0 else 0.0)
    return tuple(out)


def rank_blocks(plan: Plan, rank: int) -> list[int] | None:
    """The blocks ``rank`` computes: a pipeline's stages on its position
    (``balance.position_blocks``), else all (None)."""
    if not plan.is_pipeline:
        return None
    return position_blocks(plan.stage_split, plan.pp_degree)[plan.coords(rank)[0]]


def stage_fractions(plan: Plan, profile: ModelProfile, cluster: Cluster) -> tuple[float, ...]:
    """Each rank's share of the whole model's work, as the cost model splits a device's
    seconds per sample (1.0 for a layout whose ranks each run the whole model): a
    pipeline rank's compute per sample over it is that device's whole-model figure."""
    out = []
    for r, dev in enumerate(plan.devices):
        idx = rank_blocks(plan, r)
        out.append(1.0 if idx is None else
                   _work_fraction(profile, idx, cluster.device(dev)))
    return tuple(out)


class StageBaseline:
    """What puts a pipeline's ranks on one footing for the straggler rule: its stages do
    different work, so a rank's compute per sample is taken as a ratio to its stage's at
    the layout's start (the median of that stage's replicas then: ``first``, the ranks'
    figures over the layout's first steps, else those of the first call). There the
    stages read alike and the replicas of one stage compare directly (a slow replica shows
    at once); a rank that slows later reads slower than its peers, whatever the blocks'
    weights say. One per run of a layout: the caller makes a new one when the layout (or
    its world) changes, and a re-split starts anew (the straggler it answered is then part
    of the split).

    ``known``: per rank, how much slower than its peers the last decision found it (its
    ``peer_ratios``; 1 for the others): a rank already slow when the layout starts has its
    footing taken as its first figure over that, so it reads as slow as it is (the re-split
    follows the stages' measured times, ``observe``); none in the re-cut that answered the
    straggler (its split holds it: ``carried``). Without it a job that switched to a
    pipeline after a rank slowed (``auto`` found pp2 faster than dp with a 6x straggler)
    took the straggler's pace for its stage's norm: never named, its blocks never moved
    (live auto jobs ran their 2800 steps so on a split of [2, 3] blocks whose stage times
    called for [4, 1])."""

    def __init__(self) -> None:
        self._base: tuple[float, ...] | None = None

    def __call__(self, plan: Plan, rank_s: Sequence[float],
                 first: Sequence[float] = (), known: Sequence[float] = ()
                 ) -> tuple[float, ...]:
        if self._base is None:
            at = first if len(first) == len(rank_s) else rank_s
            if len(known) == len(at):
                at = [t / k if k > 0 else t for t, k in zip(at, known, strict=True)]
            self._base = tuple(statistics.median(t for r, t in enumerate(at)
                                                 if plan.coords(r)[0] == p)
                               for p in range(plan.pp_degree))
        base = self._base
        return tuple(t / base[plan.coords(r)[0]] if base[plan.coords(r)[0]] > 0 else t
                     for r, t in enumerate(rank_s))


def peer_ratios(rank_s: Sequence[float], ranks: Sequence[int]) -> dict[int, float]:
    """Each of ``ranks``' figure over its peers' median (``ReplanPolicy.slower``'s
    reference): how much slower than its peers a named straggler runs."""
    refs = {r: peer_median(rank_s, r) for r in ranks}
    return {r: rank_s[r] / ref for r, ref in refs.items() if ref > 0}


def slowness(rank_s: Sequence[float], slow: Collection[int], ids: Sequence[str],
             unapplied: Mapping[str, float], bar: float) -> dict[str, float]:
    """How much slower than its peers each straggler runs, by id: what the next layout's
    footing takes out (``StageBaseline``'s ``known``). The ranks named (``slow``) at their
    ``peer_ratios``; a rank whose footing held its known slowness (``unapplied``: the
    re-split that answered it, where it reads as its stage's norm) at its ratio times that,
    while above ``bar`` (was: forgotten there, and the next pipeline took it for the norm
    again; a rank that recovers reads 1/k there, and is dropped)."""
    out = {}
    for r, k in peer_ratios(rank_s, range(len(rank_s))).items():
        k *= unapplied.get(ids[r], 1.0)
        if r in slow or (ids[r] in unapplied and k > bar):
            out[ids[r]] = k
    return out


def carried(slow_by: Mapping[str, float], answered: bool, pipeline: bool
            ) -> tuple[dict[str, float], dict[str, float]]:
    """What a new layout starts with of the last decision's ``slowness`` (``slow_by``): the
    footing's ``known`` (none in the re-cut that ``answered`` it), and what that footing
    then holds unapplied (``slowness``'s ``unapplied``: a pipeline's answering re-split)."""
    return ({} if answered else dict(slow_by),
            dict(slow_by) if answered and pipeline else {})

def fixed_fractions(plan: Plan, model: CostModel | None, profile: ModelProfile | None,
               cluster: Cluster | None) -> tuple[float, ...]:
    """Each rank's fixed costs per sample (``fixed_per_sample``) as a fraction of the
    model's whole figure per sample at ``plan`` (what ``balance.recut_shares`` takes); ()
    without a model."""
    if model is None or profile is None or cluster is None:
        return ()
    fixed = fixed_per_sample(plan, model, profile, cluster)
    out = []
    for dev, f in zip(plan.devices, fixed, strict=True):
        own = model.sample_time(cluster.device(dev), profile)
        out.append(f / (own + f) if own + f > 0 else 0.0)
    return tuple(out)
