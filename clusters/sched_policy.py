"""Many jobs on one cluster: pure scheduling policies, ``decide(observation) -> decision``.

A scheduler owns ``capacity`` workers (devices) and the jobs submitted to it. At each
decision it observes every job that is queued or running (``JobState``: its size limits, the
steps it has left, and its *options*: the predicted seconds per step for each number of
workers and layout that fits its memory, from the cost model, calibrated by what the job
measured) and a policy returns an ``Allocation`` per job: how many workers, which layout, the
predicted remaining time there, and why. The live scheduler (``elastic.sched``) carries the
decision out through each job's in-place ``scale`` and ``switch`` requests, at step
boundaries; the simulator (``clusters.sched_sim``) runs the same classes over a synthetic
trace. Nothing here imports torch or Ray or reads a clock: ``Observation.now_s`` is given.

Rules every policy keeps:

* a job gets 0 workers (queued) or a size in ``min_workers..max_workers`` that one of its
  options fits (memory: a size without an option does not fit);
* a running job is never stopped to make room (preemption is a shrink, to its smallest size,
  never below), so only queued jobs wait;
* a running job keeps its size unless the change is worth more than ``resize_s`` of its time
  (hysteresis: a resize pauses the job a few seconds) or its workers are needed by others.

Policies:

* ``FifoStatic``: the baseline: in submission order, each job gets the size it asked for
  (``requested``, within the capacity) once that many workers are free, and keeps it to
  its end;
* ``ShortestRemaining``: A-SRPT-style: least predicted remaining work (worker-seconds) first;
  each job in that order gets the size that finishes it soonest among those that still use
  workers well (``efficiency``), running jobs shrink to make room for shorter ones;
* ``Goodput``: Pollux/Sia-style: admit in arrival order, then hand out the remaining workers
  one size step at a time to the job whose speedup (goodput relative to its smallest size)
  grows most per worker; goodput = throughput x the statistical efficiency of the batch
  (1 when the global batch is fixed, as in elastic; ``statistical_efficiency``);
* ``StarvationGuard``: part of both elastic policies: a job queued longer than
  ``max_wait_s`` is admitted before any other, shrinking running jobs if it must; while it
  still does not fit, the workers are held for it (no other job admitted, none grown).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "LAYOUT_TIE",
    "Option",
    "JobState",
    "Observation",
    "Allocation",
    "Decision",
    "StarvationGuard",
    "FifoStatic",
    "ShortestRemaining",
    "Goodput",
    "SchedPolicy",
    "statistical_efficiency",
    "POLICIES",
    "policy_named",
]


LAYOUT_TIE = 0.02  # layouts predicted within 2 % of each other count as equally fast


@dataclass(frozen=True, slots=True)
class Option:
    """One way to run a job: ``workers`` ranks in ``layout``, ``step_s`` seconds per step."""

    workers: int
    layout: str
    step_s: float


_MEMO: dict[tuple[int, int, int, str | None], tuple[tuple[Option, ...], dict[int, Option]]] = {}


def _by_size(options: tuple[Option, ...], lo: int, hi: int, layout: str | None
             ) -> dict[int, Option]:
    """The fastest option per size within ``lo..hi``, sizes ascending; within ``LAYOUT_TIE``
    of the fastest, ``layout`` (the one the job runs in), else the first listed: a switch for
    a prediction inside the cost model's error is not worth making. Memoized per options
    tuple (a scheduler observes the same jobs every round)."""
    key = (id(options), lo, hi, layout)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is options:
        return hit[1]
    fastest: dict[int, float] = {}
    for o in options:
        if lo <= o.workers <= hi and o.step_s > 0:
            fastest[o.workers] = min(o.step_s, fastest.get(o.workers, math.inf))
    out: dict[int, Option] = {}
    for o in options:
        t = fastest.get(o.workers)
        if t is None or o.step_s > t * (1 + LAYOUT_TIE):
            continue
        if o.workers not in out or (o.layout == layout != out[o.workers].layout):
            out[o.workers] = o
    out = dict(sorted(out.items()))
    if len(_MEMO) > 8192:
        _MEMO.clear()
    _MEMO[key] = (options, out)
    return out


@dataclass(slots=True)
class JobState:
    """What a policy sees of one job (read-only by convention: a plain slotted record, since
    a simulated week builds millions of them and a frozen dataclass is ten times slower).

    ``submitted_s``: when it was submitted (the observation's clock); ``remaining_steps``:
    steps left; ``options``: every (workers, layout) that fits its memory, with its predicted
    step time; ``requested``: the size it asked for (``num_workers``: what FIFO-static gives);
    ``workers``/``layout``: its allocation now (0: queued). A queued job has waited
    ``now_s - submitted_s`` (no job goes back to the queue: nothing is ever stopped to make
    room). Statistical efficiency (``Goodput``): ``batch`` is the global batch; with
    ``adaptive_batch`` the batch grows with the workers (``batch_per_worker``) and
    ``noise_scale`` (the gradient noise scale, Pollux's phi) discounts it; elastic keeps the
    batch fixed (``adaptive_batch=False``), so goodput is throughput."""

    job: str
    submitted_s: float
    remaining_steps: float
    options: tuple[Option, ...]
    min_workers: int = 1
    max_workers: int = 1
    requested: int = 1
    workers: int = 0
    layout: str | None = None
    batch: int = 1
    adaptive_batch: bool = False
    batch_per_worker: int = 0
    noise_scale: float | None = None

    by_size: dict[int, Option] = field(init=False, repr=False, compare=False)
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    running: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.by_size = _by_size(self.options, self.min_workers, self.max_workers, self.layout)
        self.sizes = tuple(self.by_size)  # the sizes it can run at, ascending
        self.running = self.workers > 0

    def remaining_s(self, n: int) -> float:
        """Predicted seconds to finish on ``n`` workers (inf at a size it cannot run at)."""
        o = self.by_size.get(n)
        return self.remaining_steps * o.step_s if o is not None else math.inf

    def goodput(self, n: int) -> float:
        """Samples per second on ``n`` workers times the batch's statistical efficiency."""
        o = self.by_size.get(n)
        if o is None:
            return 0.0
        batch = self.batch_at(n)
        return batch / o.step_s * statistical_efficiency(batch, self.batch, self.noise_scale)

    def batch_at(self, n: int) -> int:
        if self.adaptive_batch and self.batch_per_worker > 0:
            return max(self.batch, self.batch_per_worker * n)
        return self.batch

    def requested_size(self, capacity: int | None = None) -> int | None:
        """The size FIFO-static gives: ``requested``, or the next size up that fits, within
        ``capacity`` (a request beyond it: the largest size up to it); None: no size fits.
        Was: 8 on a 4-worker scheduler, never admitted, and the line behind it blocked."""
        fits = [s for s in self.sizes if capacity is None or s <= capacity]
        up = [s for s in fits if s >= self.requested]
        return up[0] if up else (fits[-1] if fits else None)


def statistical_efficiency(batch: int, base_batch: int, noise_scale: float | None) -> float:
    """Pollux's efficiency of training with ``batch`` instead of ``base_batch``: progress per
    sample relative to the base, (phi + M0) / (phi + M) with phi the gradient noise scale
    (Qiao et al., OSDI'21, eq. 4). 1 when the batch does not change or phi is unknown."""
    if noise_scale is None or batch <= base_batch:
        return 1.0
    return (noise_scale + base_batch) / (noise_scale + batch)


@dataclass(frozen=True)
class Observation:
    """Every queued or running job, in submission order, and the workers the scheduler owns."""

    now_s: float
    capacity: int
    jobs: tuple[JobState, ...]


class Allocation(NamedTuple):
    """A job's size (0: queued), layout, predicted remaining seconds there, and why."""

    job: str
    workers: int
    layout: str | None
    remaining_s: float
    reason: str


@dataclass(frozen=True)
class Decision:
    """One ``Allocation`` per observed job, in the observation's order."""

    allocations: tuple[Allocation, ...]

    def of(self, job: str) -> Allocation:
        for a in self.allocations:
            if a.job == job:
                return a
        raise KeyError(job)

    @property
    def used(self) -> int:
        return sum(a.workers for a in self.allocations)


@dataclass(frozen=True)
class StarvationGuard:
    """A queued job that waited more than ``max_wait_s`` goes before every other (longest
    wait first), and while it does not fit the workers are held for it; None: no guard."""

    max_wait_s: float | None = 1800.0

    def starving(self, j: JobState, now_s: float) -> bool:
        return (self.max_wait_s is not None and not j.running
                and now_s - j.submitted_s > self.max_wait_s)


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{s:.0f}s" if s < 600 else (f"{s / 60:.0f}min" if s < 36000 else f"{s / 3600:.1f}h")


def _decision(obs: Observation, sizes: dict[str, int], why: dict[str, str]) -> Decision:
    out = []
    for j in obs.jobs:
        o = j.by_size.get(sizes.get(j.job, 0))
        out.append(Allocation(j.job, 0, None, math.inf, why.get(j.job, "")) if o is None else
                   Allocation(j.job, o.workers, o.layout, j.remaining_steps * o.step_s,
                              why.get(j.job, "")))
    return Decision(tuple(out))


def _change(j: JobState, n: int) -> str:
    if not j.running:
        return f"admitted at {n} workers"
    if n == j.workers:
        return f"keeps {n} workers"
    return f"{'grown' if n > j.workers else 'shrunk'} {j.workers}->{n} workers"


@dataclass(frozen=True)
class FifoStatic:
    """First in, first out, at the size asked for, kept to the end (no resize ever). A job
    that does not fit yet blocks the ones behind it (``backfill=False``, as a plain FIFO
    queue) or lets smaller ones pass (``backfill=True``)."""

    backfill: bool = False
    name: str = "fifo-static"

    def decide(self, obs: Observation) -> Decision:
        free = obs.capacity - sum(j.workers for j in obs.jobs if j.running)
        sizes = {j.job: j.workers for j in obs.jobs if j.running}
        why = {j.job: f"fifo: keeps the {j.workers} workers it started with"
               for j in obs.jobs if j.running}
        blocked, waiting = False, 0
        for j in (q for q in obs.jobs if not q.running):
            n = j.requested_size(obs.capacity)
            if n is None:
                why[j.job] = ("cannot run: no size between min_workers and max_workers fits"
                              if not j.sizes else f"cannot run: its smallest size "
                              f"{j.sizes[0]} passes the capacity {obs.capacity}")
                continue
            if not blocked and n <= free:
                sizes[j.job], free = n, free - n
                why[j.job] = f"fifo: admitted at the {n} workers it asked for"
            else:
                waiting += 1
                why[j.job] = (f"fifo: queued ({waiting} in line), needs {n} workers, "
                              f"{max(free, 0)} free")
                blocked = blocked or not self.backfill
        return _decision(obs, sizes, why)


class _Elastic:
    """What the elastic policies share: no kill, starvation first, hysteresis, fill."""

    starvation: StarvationGuard
    resize_s: float

    def _floor(self, obs: Observation) -> tuple[dict[str, int], int]:
        """Every running job at its smallest size (never below: preemption is a shrink)."""
        sizes: dict[str, int] = {}
        free = obs.capacity
        for j in obs.jobs:
            if j.running and j.sizes:
                sizes[j.job] = j.sizes[0]
                free -= j.sizes[0]
        return sizes, free

    def _holds(self, j: JobState, obs: Observation) -> bool:
        """Whether ``j``, which does not fit now, is starving and could run once workers
        free up: the rest of the decision then holds capacity for it (no other job is
        admitted or grown; running jobs drain into it as they end). Was: the jobs behind it
        took the workers it waited for, and a 4-worker job among 1-worker ones waited for
        the stream to stop (7020 s with a 1800 s guard)."""
        return (self.starvation.starving(j, obs.now_s) and bool(j.sizes)
                and j.sizes[0] <= obs.capacity)

    @staticmethod
    def _held(j: JobState, free: int, now_s: float) -> str:
        return (f"starving: waited {_fmt_s(now_s - j.submitted_s)}, needs {j.sizes[0]} "
                f"workers, {max(free, 0)} free; held for it")

    def _cost(self, j: JobState, n: int) -> float:
        """Remaining seconds at ``n``, with the pause a resize costs a running job."""
        return j.remaining_s(n) + (self.resize_s if j.running and n != j.workers else 0.0)

    def _settle(self, obs: Observation, sizes: dict[str, int], free: int,
                why: dict[str, str], hold: bool = False) -> int:
        """Hysteresis and fill, after the policy's pass: a running job shrunk while workers
        stayed free gets its size back; a change worth less than ``resize_s`` is undone;
        workers still free go to running jobs (shortest remaining first) when that saves more
        than ``resize_s``, unless they are held for a starving job (``hold``)."""
        running = [j for j in obs.jobs if j.running and j.job in sizes]
        for j in running:  # a shrink nobody needed
            n = sizes[j.job]
            if n < j.workers and j.workers in j.by_size and j.workers - n <= free:
                free -= j.workers - n
                sizes[j.job] = j.workers
                why[j.job] = f"keeps {j.workers} workers (nothing needs them)"
        for j in running:  # a grow not worth its pause
            n = sizes[j.job]
            if n > j.workers and j.remaining_s(j.workers) - j.remaining_s(n) < self.resize_s:
                free += n - j.workers
                sizes[j.job] = j.workers
                why[j.job] = (f"keeps {j.workers} workers (growing saves less than the "
                              f"{_fmt_s(self.resize_s)} a resize costs)")
        if hold:
            return free
        for j in sorted(running, key=lambda j: j.remaining_s(sizes[j.job])):
            n = sizes[j.job]
            best = n
            for s in j.sizes:
                if n < s <= n + free and self._cost(j, s) < self._cost(j, best):
                    best = s
            if best != n and j.remaining_s(j.workers) - j.remaining_s(best) >= self.resize_s:
                free -= best - n
                sizes[j.job] = best
                why[j.job] = (f"{_change(j, best)}: idle workers, "
                              f"{_fmt_s(j.remaining_s(best))} left there")
        return free


@dataclass(frozen=True)
class ShortestRemaining(_Elastic):
    """A-SRPT-style: jobs in order of predicted remaining work (``key``; starving jobs
    first); each gets the size, among those free, that finishes it soonest,
    growing only while a step up in workers speeds it by at least ``efficiency`` of linear
    (0.5: doubling the workers must make it 1.5x faster). Running jobs first shrink to their
    smallest size, so a shorter job takes their workers (preemption by shrinking); what
    nobody needed is given back (``_settle``)."""

    efficiency: float = 0.5
    resize_s: float = 30.0
    starvation: StarvationGuard = field(default_factory=StarvationGuard)
    name: str = "srpt"

    def key(self, j: JobState, now_s: float) -> tuple[int, float, float]:
        """Starving jobs first (longest wait first), then least remaining work, then the
        earliest submitted. Work is worker-seconds at the job's smallest size (its most
        efficient one): A-SRPT's single-machine instance, where a job's size is its
        remaining processing time on one unit. Ranking by remaining *time* at the size asked
        for instead favours wide jobs: one asking for 4 workers with 8 s left there (some
        32 worker-seconds) went ahead of a 1-worker job with 10 s left. Over random 4-worker
        traces in the simulator (``bench/srpt_order.py``: 8 and 16 jobs, load 0.7-1.5, warm
        and cold starts, 300 seeds each) least work first lowered the mean JCT against
        FIFO-static by a further 1.1-4.7 points."""
        if self.starvation.starving(j, now_s):
            return (0, j.submitted_s, 0.0)
        return (1, self.work_s(j), j.submitted_s)

    @staticmethod
    def work_s(j: JobState) -> float:
        """Remaining worker-seconds at the smallest size ``j`` runs at (inf: none fits)."""
        return j.remaining_s(j.sizes[0]) * j.sizes[0] if j.sizes else math.inf

    def _best(self, j: JobState, limit: int) -> int | None:
        """The size up to ``limit`` that finishes ``j`` soonest while each step up stays
        efficient; None when not even its smallest size fits."""
        best, best_t = None, math.inf
        for s, o in j.by_size.items():
            if s > limit:
                break
            t = o.step_s
            if best is not None and best_t / t - 1 < self.efficiency * (s / best - 1):
                break
            best, best_t = s, t
        if best is not None and j.running and j.workers <= limit and j.workers in j.by_size:
            if self._cost(j, j.workers) <= self._cost(j, best):
                best = j.workers  # not worth a resize
        return best

    def decide(self, obs: Observation) -> Decision:
        sizes, free = self._floor(obs)
        why: dict[str, str] = {}
        now = obs.now_s
        order = sorted(obs.jobs, key=lambda j: self.key(j, now))
        rank = {j.job: i for i, j in enumerate(order)}
        hold: JobState | None = None  # a starving job that does not fit yet
        for j in order:
            have = sizes.get(j.job, 0)
            if hold is not None and not j.running:
                why[j.job] = f"queued: workers held for starving {hold.job}"
                continue
            # held: a running job may keep its size, not grow
            n = self._best(j, free + have if hold is None else min(free + have, j.workers))
            if n is None:
                why[j.job] = self._queued(j, free, rank[j.job])
                if hold is None and self._holds(j, obs):
                    hold, why[j.job] = j, self._held(j, free, now)
                continue
            free -= n - have
            sizes[j.job] = n
            lead = ("starving: waited " + _fmt_s(now - j.submitted_s) + ", goes first"
                    if self.starvation.starving(j, now) else
                    f"#{rank[j.job] + 1} by remaining work")
            why[j.job] = f"{lead}; {_change(j, n)}, {_fmt_s(j.remaining_s(n))} left"
        self._settle(obs, sizes, free, why, hold is not None)
        return _decision(obs, sizes, why)

    @staticmethod
    def _queued(j: JobState, free: int, rank: int) -> str:
        if not j.sizes:
            return "cannot run: no size between min_workers and max_workers fits"
        return (f"queued: #{rank + 1} by remaining work, needs {j.sizes[0]} workers, "
                f"{max(free, 0)} free")


_SPEEDUPS: dict[tuple[object, ...], tuple[dict[int, Option], dict[int, float]]] = {}


@dataclass(frozen=True)
class Goodput(_Elastic):
    """Pollux/Sia-style: queued jobs are admitted at their smallest size in arrival order
    (starving ones first) while it fits; the workers left go, one size step at a time, to the
    job whose speedup grows most per added worker, where speedup = goodput(n) /
    goodput(smallest size) and goodput = samples/s x ``statistical_efficiency`` (so with a
    fixed global batch, throughput). A step that adds less than ``min_gain`` speedup per
    worker is not taken. ``power`` < 1 favours jobs with little speedup so far (Pollux's
    fitness p; 1: the sum of speedups)."""

    min_gain: float = 0.05
    power: float = 1.0
    resize_s: float = 30.0
    starvation: StarvationGuard = field(default_factory=StarvationGuard)
    name: str = "goodput"

    def speedups(self, j: JobState) -> dict[int, float]:
        """Speedup at each size: goodput there / goodput at its smallest size (to the
        ``power``). Memoized: it depends on the options, not on the steps left."""
        key = (id(j.by_size), j.batch, j.adaptive_batch, j.batch_per_worker, j.noise_scale,
               self.power)
        hit = _SPEEDUPS.get(key)
        if hit is not None and hit[0] is j.by_size:
            return hit[1]
        good = {n: j.goodput(n) for n in j.sizes}
        base = good[j.sizes[0]] if j.sizes else 0.0
        out = {n: g / base if base > 0 else 0.0 for n, g in good.items()}
        if self.power != 1.0:
            out = {n: v ** self.power if v > 0 else 0.0 for n, v in out.items()}
        if len(_SPEEDUPS) > 8192:
            _SPEEDUPS.clear()
        _SPEEDUPS[key] = (j.by_size, out)
        return out

    def decide(self, obs: Observation) -> Decision:
        sizes, free = self._floor(obs)
        why: dict[str, str] = {j.job: f"keeps its smallest size {n} (never stopped)"
                               for j in obs.jobs if (n := sizes.get(j.job))}
        now = obs.now_s
        queued = sorted((j for j in obs.jobs if not j.running),
                        key=lambda j: (0 if self.starvation.starving(j, now) else 1,
                                       j.submitted_s))
        hold: JobState | None = None  # a starving job that does not fit yet
        for pos, j in enumerate(queued):
            if hold is not None:
                why[j.job] = f"queued: workers held for starving {hold.job}"
            elif j.sizes and j.sizes[0] <= free:
                sizes[j.job] = j.sizes[0]
                free -= j.sizes[0]
                why[j.job] = ("starving: admitted first" if self.starvation.starving(j, now)
                              else "admitted in arrival order") + f" at {j.sizes[0]} workers"
            else:
                why[j.job] = ("cannot run: no size between min_workers and max_workers fits"
                              if not j.sizes else f"queued: {pos + 1} in line, needs "
                              f"{j.sizes[0]} workers, {max(free, 0)} free")
                if self._holds(j, obs):
                    hold, why[j.job] = j, self._held(j, free, now)
        free = self._grow(obs, sizes, free, why, hold is not None)
        self._settle(obs, sizes, free, why, hold is not None)
        return _decision(obs, sizes, why)

    def _grow(self, obs: Observation, sizes: dict[str, int], free: int,
              why: dict[str, str], hold: bool = False) -> int:
        """Greedy: the next size step with the most speedup per added worker, while any
        step gains at least ``min_gain`` per worker and workers are free. ``hold``: the free
        workers are held for a starving job: a job only gets back to the size it has."""
        jobs = {j.job: j for j in obs.jobs if j.job in sizes}
        cap = {name: max(j.workers, sizes[name]) if hold else math.inf
               for name, j in jobs.items()}
        speed = {name: self.speedups(j) for name, j in jobs.items()}
        heap: list[tuple[float, int, str, int]] = []
        grown: set[str] = set()
        seq = 0

        def push(j: JobState) -> None:
            nonlocal seq
            n = sizes[j.job]
            s = next((s for s in j.sizes if s > n), None)
            if s is None or s > cap[j.job]:
                return
            sp = speed[j.job]
            gain = (sp[s] - sp[n]) / (s - n)
            if j.running and s == j.workers:
                gain += 1.0  # back to the size it runs at: no resize
            heapq.heappush(heap, (-gain, seq, j.job, s))
            seq += 1

        for j in jobs.values():
            push(j)
        while heap and free > 0:
            neg, _, name, s = heapq.heappop(heap)
            if s - sizes[name] > free or -neg < self.min_gain:
                continue
            free -= s - sizes[name]
            sizes[name] = s
            grown.add(name)
            push(jobs[name])
        for name in grown:
            j, s = jobs[name], sizes[name]
            why[name] = (f"{_change(j, s)}: speedup {speed[name][s]:.2f}x of its smallest "
                         f"size, {_fmt_s(j.remaining_s(s))} left")
        return free


SchedPolicy = FifoStatic | ShortestRemaining | Goodput

POLICIES = ("fifo-static", "srpt", "goodput")


def policy_named(name: str, *, resize_s: float = 30.0, max_wait_s: float | None = 1800.0
                 ) -> SchedPolicy:
    """The policy called ``name`` (``POLICIES``); ``ValueError`` naming them otherwise."""
    guard = StarvationGuard(max_wait_s)
    if name == "fifo-static":
        return FifoStatic()
    if name == "srpt":
        return ShortestRemaining(resize_s=resize_s, starvation=guard)
    if name == "goodput":
        return Goodput(resize_s=resize_s, starvation=guard)
    raise ValueError(f"unknown scheduling policy {name!r}; use one of {', '.join(POLICIES)}")

