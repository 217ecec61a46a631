"""Many jobs on one simulated cluster: the scheduling policies over a trace.

``simulate_schedule`` replays a job trace (``clusters.job_trace``) on ``capacity`` workers
under one policy (``clusters.sched_policy``: the same classes the live scheduler runs). The
policy decides in rounds (``round_s``, as Pollux and Sia do; a round with nothing new is
skipped); between rounds each running job advances at the step time its options predict for
its size. A job's start costs ``start_s`` and a resize pauses it ``resize_s`` (what elastic's
in-place resize takes; a restart-based system would pay a checkpoint-restore instead).

Results per policy: mean job completion time (arrival to end), makespan, utilisation (worker
seconds allocated / capacity x makespan), the time spent resizing and the number of resizes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .job_speed import job_options
from .job_trace import TraceJob, trace_model
from .sched_policy import JobState, Observation, Option, SchedPolicy

__all__ = ["SchedSimConfig", "JobOutcome", "SchedResult", "simulate_schedule",
           "trace_options", "format_sched_table"]

LADDER = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class SchedSimConfig:
    """``round_s``: seconds between the scheduler's decisions; ``start_s``: a job's start
    (workers handed over, group formed); ``resize_s``: a resize's pause; ``horizon_s``: the
    simulation ends here even if jobs are left (None: when every job is done)."""

    round_s: float = 60.0
    start_s: float = 5.0
    resize_s: float = 10.0
    horizon_s: float | None = None


@dataclass(frozen=True)
class JobOutcome:
    name: str
    arrival_s: float
    start_s: float
    end_s: float
    resizes: int
    resize_time_s: float

    @property
    def jct_s(self) -> float:
        return self.end_s - self.arrival_s


@dataclass(frozen=True)
class SchedResult:
    policy: str
    capacity: int
    jobs: tuple[JobOutcome, ...]
    makespan_s: float
    worker_s: float  # worker-seconds allocated
    decisions: int
    unfinished: int = 0

    @property
    def mean_jct_s(self) -> float:
        done = [j.jct_s for j in self.jobs if math.isfinite(j.end_s)]
        return sum(done) / len(done) if done else math.inf

    @property
    def utilisation(self) -> float:
        return self.worker_s / (self.capacity * self.makespan_s) if self.makespan_s else 0.0

    @property
    def resizes(self) -> int:
        return sum(j.resizes for j in self.jobs)

    @property
    def resize_time_s(self) -> float:
        return sum(j.resize_time_s for j in self.jobs)


def trace_options(device: str = "A100-80GB", ladder: Sequence[int] = LADDER
                  ) -> Callable[[TraceJob], tuple[Option, ...]]:
    """``options_of`` for ``simulate_schedule``: the planner's fastest data-parallel layout
    per ladder size for the job's model, computed once per model."""
    cache: dict[str, tuple[Option, ...]] = {}

    def options_of(job: TraceJob) -> tuple[Option, ...]:
        if job.model not in cache:
            profile, batch = trace_model(job.model)
            best: dict[int, Option] = {}
            for o in job_options(profile, batch, device, ladder):
                if o.workers not in best or o.step_s < best[o.workers].step_s:
                    best[o.workers] = o
            cache[job.model] = tuple(best[n] for n in sorted(best))
        return cache[job.model]

    return options_of


@dataclass
class _Run:
    """A job's simulated state."""

    spec: TraceJob
    options: tuple[Option, ...]
    steps: float
    remaining: float
    workers: int = 0
    layout: str | None = None
    step_s: float = math.inf
    paused_until: float = 0.0
    at: float = 0.0  # progress is counted up to here
    start: float = math.inf
    end: float = math.inf
    resizes: int = 0
    resize_time: float = 0.0
    version: int = 0
    options_by_size: dict[int, Option] = field(default_factory=dict)
    state: JobState | None = None  # what the policy saw last (reused while unchanged)

    def observe(self) -> JobState:
        s = self.state
        if s is None or s.remaining_steps != self.remaining or s.workers != self.workers:
            j = self.spec
            s = self.state = JobState(j.name, j.arrival_s, self.remaining, self.options,
                                      j.min_workers, j.max_workers, j.requested, self.workers,
                                      self.layout)
        return s

    def advance(self, t: float) -> None:
        if self.workers and t > self.at:
            go = max(self.at, self.paused_until)
            if t > go:
                self.remaining = max(0.0, self.remaining - (t - go) / self.step_s)
        self.at = t

    def finish_at(self) -> float:
        return max(self.at, self.paused_until) + self.remaining * self.step_s


def _placeable(r: _Run, capacity: int) -> bool:
    """Whether some size the job runs at fits the capacity at all (one that cannot is left
    unfinished: no round waits for it): the policies' sizes (``JobState.sizes``: within
    ``min_workers..max_workers``, its memory fits), whatever size it asked for. Was: any
    option up to the capacity, one below ``min_workers`` too."""
    return any(s <= capacity for s in r.observe().sizes)


def simulate_schedule(trace: Sequence[TraceJob], capacity: int, policy: SchedPolicy,
                      options_of: Callable[[TraceJob], tuple[Option, ...]],
                      config: SchedSimConfig | None = None) -> SchedResult:
    """Run ``trace`` on ``capacity`` workers under ``policy``; see the module docstring.
    A job whose options fit no size is left unfinished (counted in ``unfinished``)."""
    cfg = config or SchedSimConfig()
    runs: list[_Run] = []
    for j in trace:
        opts = options_of(j)
        by = {o.workers: o for o in opts}
        ref = by.get(j.requested) or next((by[s] for s in sorted(by) if s >= j.requested),
                                          None) or (by[max(by)] if by else None)
        steps = j.duration_s / ref.step_s if ref is not None else math.inf
        runs.append(_Run(j, opts, steps, steps, options_by_size=by))
    arrivals = sorted(range(len(runs)), key=lambda i: runs[i].spec.arrival_s)
    ends: list[tuple[float, int, int]] = []  # (time, version, run index)
    active: list[int] = []  # queued or running, in arrival order
    nxt = 0
    t = 0.0
    worker_s = 0.0
    used = 0
    decisions = 0
    dirty = False
    waiting = True  # rounds while a job waits (off once one changed nothing, see below)
    horizon = cfg.horizon_s if cfg.horizon_s is not None else math.inf
    while True:
        t_arr = runs[arrivals[nxt]].spec.arrival_s if nxt < len(arrivals) else math.inf
        while ends and runs[ends[0][2]].version != ends[0][1]:
            heapq.heappop(ends)
        t_end = ends[0][0] if ends else math.inf
        # a round when something changed, and every round while a job waits (the live
        # scheduler ticks every round: a starvation guard's wait runs out between events)
        queued = waiting and any(runs[i].workers == 0 and _placeable(runs[i], capacity)
                                 for i in active)
        t_round = ((math.floor(t / cfg.round_s) + 1) * cfg.round_s if dirty or queued
                   else math.inf)
        t_next = min(t_arr, t_end, t_round, horizon)
        if not math.isfinite(t_next):
            break
        worker_s += used * (t_next - t)
        t = t_next
        if t >= horizon:
            break
        if t == t_end:
            _, _, i = heapq.heappop(ends)
            r = runs[i]
            r.advance(t)
            r.end, r.remaining = t, 0.0
            used -= r.workers
            active.remove(i)
            dirty = True
            continue
        if t == t_arr:
            active.append(arrivals[nxt])
            nxt += 1
            dirty = True
            continue
        # a round: observe, decide, apply
        dirty = False
        decisions += 1
        before = tuple(runs[i].workers for i in active)
        for i in active:
            if runs[i].workers:
                runs[i].advance(t)
        obs = Observation(t, capacity, tuple(runs[i].observe() for i in active))
        decision = policy.decide(obs)
        for i, a in zip(active, decision.allocations, strict=True):
            r = runs[i]
            if a.workers == r.workers:
                continue
            if r.workers == 0:
                r.start, r.paused_until = t, t + cfg.start_s
            else:
                r.resizes += 1
                r.resize_time += cfg.resize_s
                r.paused_until = max(r.paused_until, t) + cfg.resize_s
            used += a.workers - r.workers
            r.workers, r.layout = a.workers, a.layout
            r.step_s = (next((o.step_s for o in r.options if o.workers == a.workers
                              and o.layout == a.layout), r.options_by_size[a.workers].step_s)
                        if a.workers else math.inf)  # the layout the policy chose
            r.version += 1
            if a.workers:
                heapq.heappush(ends, (r.finish_at(), r.version, i))
        # with nothing left to happen (no arrival, no end), a round that changed nothing
        # is the last: nothing waiting can be placed then
        waiting = (tuple(runs[i].workers for i in active) != before or nxt < len(arrivals)
                   or bool(ends))
    outcomes = tuple(JobOutcome(r.spec.name, r.spec.arrival_s, r.start, r.end, r.resizes,
                                r.resize_time) for r in runs)
    finished = [o.end_s for o in outcomes if math.isfinite(o.end_s)]
    makespan = max(finished, default=t) - min((r.spec.arrival_s for r in runs), default=0.0)
    return SchedResult(policy.name, capacity, outcomes, makespan, worker_s, decisions,
                       sum(1 for o in outcomes if not math.isfinite(o.end_s)))


def format_sched_table(results: Sequence[SchedResult], baseline: str = "fifo-static") -> str:
    """One row per policy: mean JCT (and its change against ``baseline``), makespan,
    utilisation, resizes and the time they took."""
    base = next((r for r in results if r.policy == baseline), None)
    hdr = (f"{'policy':<13}{'jobs':>6}{'mean JCT':>11}{'vs fifo':>9}{'makespan':>11}"
           f"{'util':>7}{'resizes':>9}{'resize h':>10}{'decisions':>11}")
    rows = [hdr, "-" * len(hdr)]
    for r in results:
        vs = ("" if base is None or r is base or not math.isfinite(base.mean_jct_s) else
              f"{(r.mean_jct_s / base.mean_jct_s - 1):+.0%}")
        rows.append(f"{r.policy:<13}{len(r.jobs):>6}{_h(r.mean_jct_s):>11}{vs:>9}"
                    f"{_h(r.makespan_s):>11}{r.utilisation:>7.0%}{r.resizes:>9}"
                    f"{r.resize_time_s / 3600:>10.1f}{r.decisions:>11}")
        if r.unfinished:
            rows.append(f"  {r.policy}: {r.unfinished} jobs unfinished at the horizon")
    return "\n".join(rows)


def _h(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    return f"{s / 3600:.2f}h" if s >= 3600 else f"{s:.0f}s"
