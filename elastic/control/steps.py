"""The record of completed steps: history, the run directory's logs, the view, ``on_step``.

``StepLog`` owns the job's history (one entry per completed step, in order, each once) and
its metrics and data logs. The controller feeds it the workers' drained metrics; a step
that completed while a worker was lost (its metrics never arrived) is recorded from the plan
in force (``record(step, None, ...)``), so ``data_log.jsonl`` shows every completed step once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from strategies import StrategySpec

from ..data import share_bounds
from ..events import RunLog
from ..view import View
from .hooks import StepHook

__all__ = ["StepLog", "WATCH_MIN_S"]

WATCH_MIN_S = 0.05  # the fastest a watched job is polled (each poll is an RPC per worker
# that takes the GIL from its training thread: every 10 ms cost 6x on 2 ms steps)
WATCH_FIRST_S = 0.05  # a watched job's polls before its first step is seen
WATCH_SLACK_S = 0.002  # a watched step's poll comes this long after its expected end
PERIOD_STEPS = 6  # the step period is measured over up to this many recorded steps


class StepLog:
    """History and logs of one job. Owned by the controller's thread."""

    def __init__(self, log: RunLog | None, view: View,
                 on_step: Callable[[dict[str, Any]], Any] | None = None,
                 hook: StepHook | None = None) -> None:
        self.log = log
        self.view = view
        self.hook = hook or StepHook()
        self.on_step = on_step or (hook.on_step if hook is not None else None)
        self._gate_sent: tuple[int, int, int] | None = None  # (step, version, generation)
        self.history: list[dict[str, Any]] = []
        self.fresh = False  # whether the last ingest recorded a step
        # time.monotonic() of the last sign that the ranks were between steps: a segment's
        # start, or a completed step's metrics arriving (``hang_wait_s``)
        self.between_steps_at: float | None = None

    def show_workers(self, group: Any) -> None:
        """The view's workers, with their memory (each layout's counts come in its first
        step's metrics: ``ingest``)."""
        self.view.workers([w.info for w in group.workers])

    @property
    def next_step(self) -> int:
        """The first step not recorded yet."""
        return self.history[-1]["step"] + 1 if self.history else 0

    def watch_s(self) -> float:
        """Seconds until the next watched step's metrics should exist (from the last step's
        end and time; at least ``WATCH_MIN_S``; ``WATCH_FIRST_S`` before the first step), inf
        when none is watched: the controller polls by then, so a pruner decides about when
        its step ends, not at the next idle poll. The estimate uses the workers' clocks:
        skew between hosts only moves it."""
        if not self.history:  # the step time is not known yet
            return WATCH_FIRST_S if self.hook.watch_at(0) is not None else math.inf
        last = self.history[-1]
        nxt = self.hook.watch_at(last["step"] + 1)
        if nxt is None:
            return math.inf
        # a step's metrics are recorded when the next step's compute ends (its control
        # all-reduce overlaps that step: elastic/worker/loop.py), one period after its own
        # end; a group of one records them at once
        period = self.step_period()
        if period is None:  # one step of this generation: its time holds the start-up
            return WATCH_MIN_S
        lag = 0 if last.get("world_size") == 1 else 1
        due = last["time"] + (nxt + lag - last["step"]) * period + WATCH_SLACK_S
        return max(WATCH_MIN_S, due - time.time())

    def step_period(self) -> float | None:
        """Seconds from one step's end to the next's, over the last few steps recorded of
        the newest generation (a step's own ``step_time`` leaves out what the loop does
        between steps, and a generation's first step holds its start-up: a poll timed by
        it came ~30 steps late); None before two such steps."""
        last = self.history[-1]
        for prev in self.history[-PERIOD_STEPS:-1]:
            if prev["step"] < last["step"] and prev.get("generation") == last.get("generation"):
                return max(0.0, (last["time"] - prev["time"]) / (last["step"] - prev["step"]))
        return None

    def segment_starts(self, group: Any) -> None:
        """A segment is about to start: the ranks are between steps now; the workers get
        the hook's gate first (the first decision step may precede the first poll)."""
        self.between_steps_at = time.monotonic()
        self.send_gate(group)

    def hang_wait_s(self, hang_timeout_s: float, now: float | None = None) -> float:
        """How long ranks still inside their step after a failure may take to leave it
        before they are called hung (``hang_wait``)."""
        period = self.step_period() if self.history else None
        return hang_wait(time.monotonic() if now is None else now, self.between_steps_at,
                         hang_timeout_s, period or 0.0)

    def send_gate(self, group: Any) -> None:
        """Hand the workers the hook's gate when it is new, or new to this generation of the
        group."""
        g = self.hook.gate(self.next_step)
        if g is None or (g.step, g.version, group.generation) == self._gate_sent:
            return
        self._gate_sent = (g.step, g.version, group.generation)
        group.send_gate(g)

    def last(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    def record(self, step: int, m: dict[str, Any] | None, spec: StrategySpec,
               generation: int) -> bool:
        """Record completed ``step`` once (metrics ``m`` of rank 0, or None when it completed
        while a worker was lost): history, metrics log, view, and the data log line saying
        which rank trained which sample range of it. Returns True when ``on_step`` asked to
        stop."""
        if self.history and step <= self.history[-1]["step"]:
            return False
        gen = m["generation"] if m else generation
        entry: dict[str, Any] = {
            "step": step, "loss": m["loss"] if m else float("nan"),
            # none measured while a worker was lost (None: no tracker or chart draws a 0)
            "samples_per_s": m["samples_per_s"] if m else None,
            "step_time": m["step_time"] if m else None, "world_size": spec.world_size,
            "strategy": spec.name, "time": m["time"] if m else time.time(), "generation": gen}
        for key in ("lr", "grad_norm", "eval_loss", "skipped", "gate", "gate_time",
                    "peer_copies_off"):
            if m is not None and key in m:
                entry[key] = m[key]
        if m is None:
            entry["note"] = "completed while a worker was lost; its loss was not reported"
        self.history.append(entry)
        if m is not None:
            self.between_steps_at = time.monotonic()
        if self.log is not None:
            self.log.metric(entry)  # strict JSON: NaN written as null
            bounds = [share_bounds(spec.shares, r) for r in range(spec.world_size)]
            self.log.data({"step": step, "generation": gen, "ranges": bounds,
                           "global_samples": m["global_samples"] if m else None})
        self.view.step(entry)
        return bool(self.on_step is not None and m is not None and self.on_step(entry) is True)

    def ingest(self, workers: Sequence[Any], batches: Sequence[Sequence[dict[str, Any]]],
               spec: StrategySpec | None, generation: int,
               *on_metric: Callable[[dict[str, Any], StrategySpec | None], None]) -> bool:
        """The metrics each worker drained: update its info (speed, share), pass every
        metric to each ``on_metric`` (checkpoint notices, the closed loop), and record each completed step once
        (rank 0's metrics). Returns True when ``on_step`` asked to stop."""
        per_step: dict[int, dict[str, Any]] = {}
        for w, batch in zip(workers, batches, strict=True):
            for m in batch:
                w.info["samples_per_s"] = m["samples"] / m["step_time"] if m["step_time"] else 0
                w.info["share"] = m["samples"]
                if "memory" in m:  # a layout's first step
                    w.info["memory"] = {k: v * 4 for k, v in m["memory"].items()}  # fp32 bytes
                if m["step"] not in per_step or m["rank"] == 0:
                    per_step[m["step"]] = m
                for fn in on_metric:
                    fn(m, spec)
        self.fresh = bool(per_step)
        stop = False
        for step in sorted(per_step):
            assert spec is not None
            stop = self.record(step, per_step[step], spec, generation) or stop
        return stop

    def truncate(self, step: int) -> None:
        """Forget steps from ``step`` on: they will run again (a restore to ``step``)."""
        self.history = [h for h in self.history if h["step"] < step]


HANG_SLACK_S = 5.0  # beyond the group timeout, before a rank still in its step is hung


def hang_wait(now: float, since: float | None, hang_timeout_s: float, step_s: float) -> float:
    """Seconds to wait, at ``now``, for ranks still inside their step after a failure: until
    ``hang_timeout_s`` + ``HANG_SLACK_S`` + three steps' time (``step_s``: the ranks may be
    two steps past the last one seen) after ``since``, the last time the ranks were seen
    between steps, and at least ``HANG_SLACK_S``. A rank that has not left its step by then
    has outlived what the group's own collective timeout gives it (a healthy rank blocked on
    a hung peer leaves when its collective times out). Without ``since``: the full
    ``hang_timeout_s`` + ``HANG_SLACK_S`` from now, as before (a hang used to cost the group
    timeout twice: the survivors' collective timing out, then this wait again)."""
    full = hang_timeout_s + HANG_SLACK_S
    if since is None:
        return full
    return min(full, max(HANG_SLACK_S, since + full + 3.0 * max(0.0, step_s) - now))
