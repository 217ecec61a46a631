"""The live scheduler's loop, without Ray: a queue of elastic jobs sharing ``capacity`` workers.

``SchedulerCore`` keeps every submitted job (queued, running, ended) and, each ``tick``,
observes the queued and running ones, asks a pure policy (``clusters.sched_policy``: the same
classes the simulator runs) for a ``Decision`` and carries it out through a ``Runner``:
shrinks first (each answered at the job's next step boundary, so its workers are free
before anyone else takes them), then admissions, then growth. A running job is resized in
place (the job's own ``scale`` request), never stopped to make room. The Ray-aware part
(``elastic.scheduler``) wraps this in a named actor whose runner starts each job with
``elastic.submit`` in its own process; the tests drive it with a real runner on a real
cluster and the unit tests with a scripted one.

What the policy sees of a live job (``live_options``): its predicted step time at each size
between ``min_workers`` and ``max_workers``, from the step times it measured (fitted to
``a + b / n``: a fixed part and a part that divides among the workers); before its first
measurement, the per-sample time the other jobs measured (``prior_s_per_sample``) with a
10 % fixed part. With a fixed global batch (elastic's rule) goodput is throughput.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from clusters.sched_policy import JobState, Observation, Option, SchedPolicy

from .errors import ElasticError

__all__ = ["Runner", "QueuedJob", "EndedRun", "EndedConfig", "SchedulerCore", "live_options", "FIXED_PART",
           "SCHED_SCALE_CHECK_S", "HISTORY_KEPT", "placed", "check_start"]

# The steps of ended jobs' histories the scheduler keeps in all (~0.45 KB a step: ~90 MB):
# past it, the oldest ended jobs' are let go but their last step (their run directories'
# metrics.jsonl has every step). Was: every ended job's whole history for the scheduler's
# life, in the process that runs the live jobs' controllers.
HISTORY_KEPT = 200_000

FIXED_PART = 0.1  # before two sizes are measured: a tenth of the step does not shrink with n
SCHED_SCALE_CHECK_S = 1e9  # a scheduled job never looks for room at its size: it grows
# only when the scheduler asks (``grow_when_room`` false; it did grow by itself toward its
# max_workers, taking workers the scheduler had given to the next job)


class Runner(Protocol):
    """How the scheduler starts and resizes jobs (the real one: ``elastic.submit``)."""

    def start(self, name: str, cfg: Any, workers: int) -> Any: ...

    def scale(self, handle: Any, workers: int) -> int: ...

    def status(self, handle: Any) -> dict[str, Any]: ...

    def done(self, handle: Any) -> bool: ...

    def result(self, handle: Any) -> Any: ...

    def stop(self, handle: Any) -> None:
        """Ask the job to stop at its next step boundary, without waiting for it (the core
        reaps it once it has ended)."""
        ...

    def partial(self, handle: Any) -> tuple[list[dict[str, Any]], str | None]:
        """A job that failed: the history of the steps it completed and its run directory
        (None: it made none)."""
        ...

    def ended_at(self, handle: Any) -> float | None:
        """When the job ended, on the scheduler's clock (None: not known; the core then
        takes the time it noticed, up to a round later)."""
        ...


_ENDED = ("finished", "failed", "cancelled")


@dataclass
class EndedRun:
    """What the scheduler keeps of an ended job's result: its history and run directory, and
    its final parameters until they are read once (``take_params``). Was: the whole result
    and the job's controller, kept for ever (a sweep's scheduler grew by a model a trial)."""

    history: list[dict[str, Any]]
    run_dir: str | None = None
    params: dict[str, Any] | None = None
    taken: bool = False  # its parameters were handed out (``take_params``)
    dropped: int = 0  # steps of its history let go (``HISTORY_KEPT``); the last one is kept
    read: bool = False  # its result was read (``SchedulerActor.result``): let go first

    def take_params(self) -> dict[str, Any] | None:
        params, self.params = self.params, None
        self.taken = self.taken or params is not None
        return params


@dataclass(frozen=True)
class EndedConfig:
    """What the scheduler keeps of an ended job's config: the numbers its row and the
    prior of new jobs' speed read. Was: the whole config for the scheduler's life (an SDK
    job's in-memory dataset and code with it)."""

    max_steps: int
    min_world: int
    max_world: int
    num_workers: int
    global_batch_size: int
    strategy: Any = None

    @classmethod
    def of(cls, cfg: Any) -> EndedConfig | None:
        if cfg is None or isinstance(cfg, EndedConfig):
            return cfg
        return cls(cfg.max_steps, cfg.min_world, cfg.max_world, cfg.num_workers,
                   cfg.global_batch_size, str(getattr(cfg, "strategy", None) or "dp"))


@dataclass
class QueuedJob:
    """A job the scheduler holds. ``state``: queued | running | finished | failed |
    cancelled; ``measured``: seconds per step seen at each size; ``reason``: the policy's
    why for its allocation; ``remaining_s``: the predicted seconds left there."""

    name: str
    cfg: Any
    submitted_s: float
    state: str = "queued"
    workers: int = 0
    handle: Any = None
    measured: dict[int, float] = field(default_factory=dict)
    step: int = 0
    started_s: float | None = None
    ended_s: float | None = None
    reason: str = "submitted"
    remaining_s: float = math.inf
    error: str | None = None
    result: EndedRun | None = None
    resizes: int = 0
    resize_s: float = 0.0
    worker_s: float = 0.0  # workers x seconds held, counted up to ``counted_s``
    counted_s: float = 0.0
    busy: bool = False  # a resize is under way (its workers are reserved)
    phase: str | None = None  # a running job's controller phase (its status()["state"])

    def let_go(self) -> None:
        """An ended job: keep only the numbers of its config (``EndedConfig``)."""
        self.cfg = EndedConfig.of(self.cfg)

    def hold(self, now: float) -> None:
        """Count the workers held since the last count (utilisation)."""
        if self.workers and now > self.counted_s:
            self.worker_s += self.workers * (now - self.counted_s)
        self.counted_s = now

    def row(self) -> dict[str, Any]:
        """What ``elastic queue list`` shows."""
        c = self.cfg
        return {"job": self.name, "state": self.state, "workers": self.workers,
                "step": self.step, "max_steps": c.max_steps if c is not None else None,
                "min_workers": c.min_world if c is not None else None,
                "max_workers": c.max_world if c is not None else None,
                "submitted_s": self.submitted_s, "started_s": self.started_s,
                "ended_s": self.ended_s,  # (an ended job: nothing left, whatever was predicted)
                "remaining_s": 0.0 if self.state in _ENDED else self.remaining_s,
                "reason": self.reason, "error": self.error, "resizes": self.resizes,
                "resize_s": self.resize_s, "worker_s": self.worker_s,
                "resizing": self.busy,
                "phase": self.phase if self.state == "running" else None}


def live_options(lo: int, hi: int, measured: Mapping[int, float], batch: int,
                 prior_s_per_sample: float, layout: str) -> tuple[Option, ...]:
    """Predicted seconds per step at each size ``lo..hi`` (see the module docstring)."""
    pts = sorted((n, t) for n, t in measured.items() if t > 0)
    if len(pts) >= 2:
        xs = [1.0 / n for n, _ in pts]
        ys = [t for _, t in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        b = max(b, 0.0)
        a = max(my - b * mx, 0.0)
    else:
        n0, t0 = pts[0] if pts else (1, prior_s_per_sample * batch)
        a = FIXED_PART * t0
        b = (t0 - a) * n0
    out = []
    for n in range(lo, hi + 1):
        t = measured.get(n) or (a + b / n)
        out.append(Option(n, layout, max(t, 1e-9)))
    return tuple(out)


class SchedulerCore:
    """The queue and the decision loop (thread-safe: ``submit``/``cancel``/``rows`` may be
    called from any thread while ``tick`` runs in another)."""

    def __init__(self, policy: SchedPolicy, capacity: int, runner: Runner, *,
                 clock: Callable[[], float], on_change: Callable[[QueuedJob], Any] | None = None
                 ) -> None:
        if capacity < 1:
            raise ElasticError(f"a scheduler needs at least 1 worker of capacity, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self.runner = runner
        self.clock = clock
        self.on_change = on_change
        self.jobs: dict[str, QueuedJob] = {}
        self._lock = threading.Lock()
        self._cancels: set[str] = set()
        self._stopping: set[str] = set()  # cancelled running jobs told to stop
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="elastic-resize")
        self.decisions = 0

    # ---------------------------------------------------------------- from any thread

    def submit(self, cfg: Any, submitted_s: float | None = None,
               keep: Callable[[QueuedJob], Any] | None = None) -> str:
        """Queue ``cfg`` (a ``JobConfig``) under its job name; refuses a name held by a job
        that has not ended, and a job that could never fit the scheduler's capacity.
        ``keep``: called with the new job before any tick can see it (its stored row)."""
        if not cfg.name:
            cfg = cfg.replace(name=cfg.job_name)  # one name from here on
        name = cfg.job_name
        with self._lock:
            old = self.jobs.get(name)
            if old is not None and old.state in ("queued", "running"):
                raise ElasticError(f"a job named {name!r} is already {old.state} in this "
                                   "scheduler. Fix: pick another name or cancel it first")
            if cfg.min_world > self.capacity:
                raise ElasticError(
                    f"job {name!r} needs at least {cfg.min_world} workers; the scheduler owns "
                    f"{self.capacity}. Fix: lower min_workers or start the scheduler with more")
            job = QueuedJob(name, cfg, self.clock() if submitted_s is None else submitted_s)
            if keep is not None:  # (was: after, so a tick between could start the job and
                keep(job)  # its row then be written queued)
            self.jobs[name] = job
        self._changed(job)
        return name

    def cancel(self, name: str) -> str:
        """Cancel a queued job at once, a running one at its next tick (stopped at a step
        boundary, its final checkpoint taken). Returns the job's state before."""
        with self._lock:
            job = self.jobs.get(name)
            if job is None:
                raise ElasticError(f"no job named {name!r} in this scheduler. Fix: see "
                                   "`elastic queue list`")
            before = job.state
            if job.state == "queued":
                job.state, job.ended_s, job.reason = "cancelled", self.clock(), "cancelled"
                job.let_go()
            elif job.state == "running":
                self._cancels.add(name)
        if before == "queued":
            self._changed(job)
        return before

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return [j.row() for j in self.jobs.values()]

    # ---------------------------------------------------------------- the loop

    def tick(self) -> bool:
        """Settle finished resizes, reap ended jobs, carry out cancels, measure, decide and
        apply. Returns whether any job is still queued or running.

        Shrinks are carried out first, together, and waited for (the workers they free are
        then free); admissions follow, then growth, which is not waited for: a growth
        reserves its workers at once and the job keeps training while its new workers start
        (the job's own scale request), the next ticks deciding for the others meanwhile. A
        job whose resize is under way keeps its reserved size until it is answered; nothing
        is started or grown beyond the workers actually free."""
        self._reap()
        self._cancel_running()
        with self._lock:
            active = [j for j in self.jobs.values() if j.state in ("queued", "running")]
        if not active:
            return False
        for j in active:
            if j.state == "running" and not j.busy:
                self._measure(j)
        prior = self._prior_s_per_sample()
        now = self.clock()
        states = tuple(self._observe(j, prior) for j in active)
        decision = self.policy.decide(Observation(now, self.capacity, states))
        self.decisions += 1
        plan = list(zip(active, decision.allocations, strict=True))
        for j, a in plan:
            j.reason, j.remaining_s = a.reason, a.remaining_s
            if j.busy:
                j.reason = f"{a.reason} (a resize to {j.workers} is under way)"
        cancelled = set(self._cancels)  # (not resized on its way out)
        shrinks = [self._pool.submit(self._resize, j, a.workers) for j, a in plan
                   if j.state == "running" and not j.busy and 0 < a.workers < j.workers
                   and j.name not in cancelled]
        for f in shrinks:
            f.result()
        free = self.capacity - sum(j.workers for j in active if j.state == "running")
        for j, a in plan:
            if j.state == "queued" and 0 < a.workers <= free:
                self._start(j, a.workers)
                free -= j.workers
        for j, a in plan:
            grow = a.workers - j.workers
            if j.state == "running" and not j.busy and 0 < grow <= free \
                    and j.name not in cancelled:
                free -= grow
                with self._lock:
                    j.hold(self.clock())
                    j.workers, j.busy = a.workers, True  # reserved now
                self._pool.submit(self._resize, j, a.workers)
        for j in active:
            self._changed(j)
        return True

    def wait_resizes(self, timeout: float | None = None) -> None:
        """Wait for the resizes under way (tests, shutdown)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while any(j.busy for j in list(self.jobs.values())):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("resizes still under way")
            time.sleep(0.01)

    def _observe(self, j: QueuedJob, prior: float) -> JobState:
        cfg = j.cfg
        layout = str(getattr(cfg, "strategy", None) or "dp")
        opts = live_options(cfg.min_world, cfg.max_world, j.measured, cfg.global_batch_size,
                            prior, layout)
        lo, hi = cfg.min_world, cfg.max_world
        if j.busy:  # mid-resize: it cannot be resized again now; the policy plans around it
            lo = hi = j.workers
        return JobState(j.name, j.submitted_s, max(cfg.max_steps - j.step, 0), opts,
                        lo, hi, cfg.num_workers, j.workers,
                        layout if j.workers else None, cfg.global_batch_size)

    def _prior_s_per_sample(self) -> float:
        seen = [t / j.cfg.global_batch_size * n for j in self.jobs.values()
                for n, t in j.measured.items()]
        return sorted(seen)[len(seen) // 2] if seen else 1e-3

    def _measure(self, j: QueuedJob) -> None:
        st = self._status(j)
        j.step = int(st.get("step") or j.step)
        j.phase = st.get("state") or j.phase
        sps, world = st.get("samples_per_s"), st.get("world_size")
        if j.phase == "running" and isinstance(world, int) and 0 < world != j.workers:
            with self._lock:  # the size it runs at: a resize answered after its asker gave
                j.hold(self.clock())  # up (timed out) held workers given to another job
                j.workers = world
        if sps and world and world == j.workers and math.isfinite(sps) and sps > 0:
            t = j.cfg.global_batch_size / sps
            old = j.measured.get(world)
            j.measured[world] = t if old is None else 0.5 * old + 0.5 * t

    def _start(self, j: QueuedJob, n: int) -> None:
        with self._lock:
            if j.state != "queued":  # cancelled since the tick looked
                return
        try:  # (the config's own check too: code the scheduler cannot import fails this job
            # alone; was raised out of every tick, every queued job held behind it)
            cfg = j.cfg.replace(num_workers=n, min_workers=j.cfg.min_world,
                                max_workers=j.cfg.max_world, scale_check_s=SCHED_SCALE_CHECK_S,
                                grow_when_room=False, placement="per_worker")
            j.handle = self.runner.start(j.name, cfg, n)
        except Exception as e:  # noqa: BLE001 - a job that cannot start fails alone
            j.state, j.error, j.ended_s = "failed", f"{type(e).__name__}: {e}", self.clock()
            j.let_go()
            return
        with self._lock:  # a cancel while it started (the answer said "was queued"):
            if j.state == "cancelled":  # it is stopped at once, as a running one is
                self._cancels.add(j.name)
            j.state, j.workers, j.started_s = "running", n, self.clock()
            j.counted_s, j.phase = j.started_s, "starting"

    def _resize(self, j: QueuedJob, n: int) -> None:
        """Carry out a resize (in the pool's thread): the job's scale request, answered at
        its next step boundary. A refusal, or the job ending meanwhile, leaves it at the
        size it has; the job goes on either way."""
        t0 = self.clock()
        j.busy = True
        try:
            got = int(self.runner.scale(j.handle, n))
        except Exception as e:  # noqa: BLE001 - refused or the job ended: the job goes on
            got = None
            j.reason = f"{j.reason} (resize to {n} refused: {e})"
        with self._lock:
            if j.state != "running":  # it ended meanwhile (reaped or cancelled)
                j.busy = False
                return
            j.hold(self.clock())
            if got is not None:
                j.workers = got
                j.resizes += 1
                j.resize_s += self.clock() - t0
            else:
                st = self._status(j)
                j.workers = int(st.get("world_size") or j.workers)
            j.busy = False

    def _status(self, j: QueuedJob) -> dict[str, Any]:
        try:
            return self.runner.status(j.handle)
        except Exception:  # noqa: BLE001 - a job that ended has no status: reaped next
            return {}

    def _reap(self) -> None:
        for j in list(self.jobs.values()):
            if j.state == "running" and not j.busy and self.runner.done(j.handle):
                self._end(j)  # a job mid-resize is reaped once its request is answered

    def _bound_histories(self, newest: QueuedJob) -> None:
        """Let go of the oldest ended jobs' histories (all but each one's last step) while
        the ended jobs hold more than ``HISTORY_KEPT`` steps in all; ``newest``'s is kept
        whole (its controller held it all until now)."""
        ended = [j for j in self.jobs.values()
                 if j.result is not None and j is not newest and len(j.result.history) > 1]
        total = sum(len(j.result.history) for j in ended if j.result is not None)
        if newest.result is not None:
            total += len(newest.result.history)
        # those whose result was read first (a sweep reads its trial's at once), oldest first
        for j in sorted(ended, key=lambda j: (not (j.result is not None and j.result.read),
                                              j.ended_s if j.ended_s is not None else 0.0)):
            if total <= HISTORY_KEPT:
                break
            res = j.result
            assert res is not None
            total -= len(res.history) - 1
            res.dropped += len(res.history) - 1
            res.history = res.history[-1:]

    def _end(self, j: QueuedJob) -> None:
        now = self.clock()
        t = self.runner.ended_at(j.handle)  # trusted only as a time this job ran
        start = j.started_s if j.started_s is not None else now
        end = t if t is not None and start <= t <= now else now
        try:
            res = self.runner.result(j.handle)
        except Exception as e:  # noqa: BLE001 - a job's failure is its own
            j.state, j.error = "failed", f"{type(e).__name__}: {e}"
            # what it trained before (was: steps 0, no history, no run directory; found by
            # a new user, session 48)
            history, run_dir = self.runner.partial(j.handle)
            j.result = EndedRun(list(history), run_dir)
            if j.result.history:
                j.step = int(j.result.history[-1]["step"]) + 1
            self._bound_histories(j)
        else:
            state_dict = getattr(res, "state_dict", None)
            j.result = EndedRun(list(getattr(res, "history", ())), getattr(res, "run_dir", None),
                                state_dict() if callable(state_dict) else None)
            j.state = "cancelled" if j.name in self._cancels else "finished"
            if j.result.history:  # its last step (a resumed job's history starts there)
                j.step = int(j.result.history[-1]["step"]) + 1
            self._bound_histories(j)
        if j.counted_s > end:  # counted past its end (a resize answered after it): undo
            j.worker_s -= j.workers * (j.counted_s - end)
            j.counted_s = end
        j.ended_s = end
        j.hold(end)
        j.workers = 0
        j.reason = j.error or j.state
        j.handle = None  # (its controller, history and final state: not kept)
        j.let_go()
        self._cancels.discard(j.name)
        self._stopping.discard(j.name)
        self._changed(j)

    def _cancel_running(self) -> None:
        """Stop each running job cancelled (once): it ends at its step boundary after its
        final checkpoint, and keeps its workers until then; ``_reap`` ends it (cancelled)
        when it has. Was: ended at once, so a final checkpoint longer than the runner's wait
        for the result marked it failed and freed workers it still held."""
        with self._lock:
            names = [n for n in self._cancels if self.jobs[n].state == "running"
                     and n not in self._stopping]
        for n in names:
            j = self.jobs[n]
            try:
                self.runner.stop(j.handle)
            except Exception:  # noqa: BLE001 - it ended on its own meanwhile
                pass
            self._stopping.add(n)
            if not j.busy and self.runner.done(j.handle):
                self._end(j)

    def _changed(self, j: QueuedJob) -> None:
        if self.on_change is not None:
            self.on_change(j)


def placed(cfg: Any) -> Any:
    """``cfg`` with its run directory (``./runs/<name>`` by default, or a relative
    ``run_dir``) made absolute where it is submitted: the scheduler's process runs its
    controller from its own working directory (was: ``ray start``'s, found by a new user,
    session 48)."""
    import os

    if cfg.run_dir and os.path.isabs(cfg.run_dir):
        return cfg
    return cfg.replace(name=cfg.job_name, run_dir=os.path.abspath(cfg.run_path))


def check_start(workers: Any, round_s: Any, resize_s: Any, max_wait_s: Any, warm: Any,
                cli: bool = False) -> None:
    """A scheduler's start settings, before its actor starts: ``ConfigError`` naming the
    setting (``--round-s`` for the CLI, ``round_s`` for ``elastic.scheduler.start``). Was,
    in the SDK: ``workers=0`` an actor's death and a stack dump, ``round_s=-1`` a scheduler
    spinning a core (found by a new user, session 48)."""
    import math

    from .errors import ConfigError

    def name(f: str) -> str:
        return "--" + f.replace("_", "-") if cli else f

    def number(f: str, v: Any, *, above: bool, fix: str) -> None:
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)
                                  and (v > 0 if above else v >= 0)):
            raise ConfigError(name(f), f"must be {'>' if above else '>='} 0, got {v}.", fix)

    if workers is not None and not (isinstance(workers, int) and workers >= 1):
        raise ConfigError(name("workers"), f"must be 1 or more, got {workers}.",
                          "give the number of workers the scheduler owns, e.g. "
                          f"{name('workers')}{' ' if cli else '='}4")  # (CLI: --cpus, --gpus too)
    number("round_s", round_s, above=True, fix="e.g. 2 (seconds between decisions)")
    number("resize_s", resize_s, above=False, fix="e.g. 10 (seconds)")
    number("max_wait_s", max_wait_s, above=False, fix="e.g. 1800 (seconds)")
    number("warm", warm, above=False, fix="e.g. 2, or 0 for no warm workers")
