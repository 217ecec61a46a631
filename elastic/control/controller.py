"""The controller: a loop over explicit states that runs one job to its end.

``run()`` is ``while not state.terminal: state = step(state)``. ``step`` is the transition
function: one handler per state record (``elastic.control.states``), each returning the next
state, every transition emitted as a ``state`` event. The controller is not in the step
path: workers train whole segments on their own, and the controller polls their metrics,
its mailbox and the checkpoint in flight while they do. Its decisions are policies
(``clusters.policy``); its work with the workers goes through a worker group
(``WorkerGroup`` on Ray, or any object with the same methods: the unit tests drive the loop
over a fake one).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from clusters.policy import GiveUp
from strategies import StrategySpec

from ..config import JobConfig
from ..errors import (
    ElasticError,
    InfrastructureError,
    InterruptedJobError,
    SwitchError,
    WorkerError,
)
from ..events import Event, RunLog
from ..failures import classify, root_cause
from ..planning import chained
from ..preflight import check_layouts
from ..trackers import with_trackers
from ..view import View
from .cadence import poll_interval, scale_interval
from .checkpoints import CheckpointTracker, last_checkpoint
from .checkpoints import unsaved as unsaved_steps
from .evacuation import Evacuation
from .hooks import StepHook
from .interrupts import Interrupts
from .layouts import Layouts
from .preflight import check_sync_norms, preflight, run_directory
from .regroup import Regroup
from .replan import Replanner
from .requests import Inbox, Request
from .sink import EventSink
from .sizing import Sizing
from .states import (
    AtBoundary,
    ControllerState,
    Evacuating,
    Failed,
    Finished,
    Finishing,
    FitResult,
    Forming,
    Placing,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
    Switching,
)
from .steps import StepLog

__all__ = ["Controller"]



# the states in which the group runs: an infrastructure error there is a recovery (a loss in
# the final gather too); before, it ends the job
_GROUP_RUNS = (Running, AtBoundary, Switching, Resizing, Recovering, Evacuating, Finishing)


class Controller:
    """Runs one job to completion. Owns its workers (through its worker group) and, when it
    started one, the local Ray. Thread-safe: ``post`` and ``status`` only."""

    def __init__(self, config: JobConfig, view: View | None = None,
                 on_step: Callable[[dict[str, Any]], Any] | None = None, *,
                 hook: StepHook | None = None, group_factory: Callable[[JobConfig], Any] | None = None,
                 mailbox_factory: Callable[[str], Any] | None = None, pool: Any = None) -> None:
        """``on_step(entry)``: called in this thread for each completed step's history entry;
        True stops the job at the next boundary. ``hook``: a ``StepHook`` (a sweep trial's
        pruner; its ``on_step`` unless one is given). ``pool``: a ``WorkerPool``."""
        config.validate()
        self.cfg = config
        self.view = with_trackers(view or View(), config)
        self.sink = EventSink(config, self.view, lambda: max(  # (a resume's: from its step)
            self.step, self.steps.next_step, self._resume[1] if self._resume else 0))
        self._emit = self.sink.emit
        self.inbox = Inbox(None, self._emit)
        self.spec: StrategySpec | None = None
        self.step = self.failures = 0
        self.phase = ControllerState.STARTING
        self._group_factory = group_factory
        self._mailbox_factory = mailbox_factory
        self._pool = pool
        self._ray_group = functools.partial(_ray_group, pool=pool)
        self.group: Any = None
        self._started_ray = False
        self.steps = StepLog(None, self.view, on_step, hook)
        self.tracker: CheckpointTracker = CheckpointTracker(config, None, self._emit)
        self.layouts: Layouts | None = None
        self.replanner = Replanner(config, None, self._emit)  # the closed loop
        self.regroup: Regroup | None = None
        self.evacuation: Evacuation | None = None
        self._resume: tuple[Any, int] | None = None
        self._segment: Any = None
        self._stop_at: int | None = None  # a stop asked for: the job ends at this step
        self.interrupts = Interrupts()
        self._rolled_back: set[int | None] = set()  # steps a non-finite rollback came from
        self._switch_done = -1  # the boundary whose scheduled switch has run
        self.sizing = Sizing(config, self.inbox)

    # ------------------------------------------------------------------ compatibility

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.steps.history

    @property
    def workers(self) -> list[Any]:
        return self.group.workers if self.group is not None else []

    @property
    def events(self) -> list[Event]:
        return self.sink.events

    @property
    def generation(self) -> int:
        return self.group.generation if self.group is not None else 0

    @property
    def state(self) -> ControllerState:
        return self.phase

    # ------------------------------------------------------------------ the loop

    def run(self) -> FitResult:
        """Run the job to its end and return its result. Raises the typed error that ended
        it; ``InterruptedJobError`` (carrying the result) after SIGINT or SIGTERM, which stop
        the job at the next step boundary (a second signal stops it at once)."""
        state: State = Starting()
        try:
            with self.interrupts.installed():
                while not state.terminal:
                    nxt = self.step_state(state)
                    self._transition(state, nxt)
                    state = nxt
        finally:
            self._cleanup()
            self.view.close()
            self.sink.close()
        if isinstance(state, Failed):
            raise state.error
        assert isinstance(state, Finished)
        if self.interrupts.signum is not None:
            state.result.status = "interrupted"
            raise InterruptedJobError(self.interrupts.signum, state.result)
        return state.result

    def _check_interrupt(self) -> None:
        self.interrupts.act(self._emit, self.post, self.tracker.store is not None)

    def step_state(self, state: State) -> State:
        """The transition function: the next state after ``state``. Infrastructure errors
        while the group runs become a recovery; any other error ends the job."""
        handlers: dict[type[State], Callable[[Any], State]] = {
            Starting: self._start, Placing: self._place, Forming: self._form,
            Running: self._run, AtBoundary: self._boundary, Switching: self._switch,
            Resizing: self._resize, Recovering: self._recover, Evacuating: self._evacuate,
            Finishing: self._finish,
        }
        try:
            return handlers[type(state)](state)
        except BaseException as e:  # noqa: BLE001 - every error ends the job, typed
            self.inbox.fail_in_hand(e, self.status())  # a request taken, not answered yet
            if isinstance(e, InfrastructureError) and isinstance(state, _GROUP_RUNS):
                return Recovering(classify(e))
            return Failed(e)

    def _transition(self, old: State, new: State) -> None:
        self.phase = new.phase
        if type(old) is not type(new) or old != new:
            self._emit("state", f"{old.describe()} -> {new.describe()}",
                       data={"from": old.phase.value, "to": new.phase.value})
        if isinstance(new, Failed) and isinstance(new.error, ElasticError):
            at = _error_step(new.error)
            self._emit("failed", str(new.error).splitlines()[0] if str(new.error) else
                       type(new.error).__name__, step=at, data={"in_step": _begun(old, at)})
        if isinstance(new, Finished):
            self._emit("finished", new.message)

    # ------------------------------------------------------------------ states

    def _start(self, _: Starting) -> State:
        cfg = self.cfg
        pre = preflight(cfg, self._emit)
        self.layouts = Layouts(cfg, pre.model, self._emit)
        self.replanner.layouts = self.layouts
        self.tracker.store = pre.store
        check_layouts(cfg, self.layouts)  # the start strategy and every switch_at target
        if cfg.resume and (cfg.resume != "auto" or self.tracker.auto_resume()):
            self._resume = self.tracker.find_resume(cfg.resume, self.layouts.probe_model)
        else:
            self.tracker.check_fresh()  # no run's steps written over another's
        if self._group_factory is None:  # on Ray: attach, or start a local one
            self._started_ray = _ray_connect(cfg, self.layouts, self._emit, self._pool,
                                             self._resume, self.tracker.store)
            self.interrupts.reclaim()
        self.inbox.mailbox = (self._mailbox_factory or _ray_mailbox)(cfg.job_name)  # the name
        self.tracker.claim(self._resume)  # and the checkpoint URI, before anything is written
        run_dir = run_directory(cfg)
        log = RunLog(run_dir)
        self.steps.log = log
        self.sink.open(log)  # what preflight said before the log existed goes first
        log.write_config(cfg.to_dict())
        self.view.start(cfg.job_name, cfg.max_steps)
        self._emit("start", f"job {cfg.job_name}: {cfg.max_steps} steps, global batch "
                   f"{cfg.global_batch_size}, {cfg.num_workers} workers, strategy {cfg.strategy}")
        self.group = (self._group_factory or self._ray_group)(cfg)
        self.regroup = Regroup(cfg, self.group, self.layouts, self.tracker, self.steps,
                               self._emit, self._drain)
        self.evacuation = Evacuation(cfg, self.group, self.layouts, self.tracker, self.regroup,
                                     self._emit, lambda: self.steps.next_step,
                                     self.sizing.after_loss)
        return Placing(cfg.num_workers)

    def _place(self, st: Placing) -> State:
        new = self.group.place(st.n, self.cfg.min_world)
        self._emit("placed", *_placed([w.info for w in new]))
        return Forming()

    def _form(self, _: Forming) -> State:
        assert self.layouts is not None
        addr, port, secs = self.group.form()
        self._emit("group", f"generation {self.group.generation}: {len(self.workers)} ranks "
                   f"via {addr}:{port} in {secs:.2f}s")
        self.view.workers([w.info for w in self.workers])
        check_sync_norms(self.layouts.probe_model, [w.info for w in self.workers])
        spec = self.layouts.make(self.cfg.strategy, len(self.workers), self.group)
        self.layouts.apply(self.group, spec, None, reason="start")
        self.spec = spec
        if self._resume is not None:
            self.step = self.tracker.resume(self.group, spec, *self._resume)
            self._resume = None  # (it may have fallen back to an older step)
        return self._next_segment()

    def _run(self, st: Running) -> State:
        """Train a segment; poll metrics, the mailbox, the checkpoint in flight and the
        room to grow while it runs."""
        self.steps.segment_starts(self.group)  # (the anchor of a hang's wait; the gate)
        seg = self._segment = self.group.start_segment(st.start, st.end)
        stop_sent = self.inbox.waiting()
        if stop_sent:  # queued meanwhile: the segment ends after one step
            self.group.request_stop(urgent=self.inbox.has("notice"))
        next_check = time.monotonic() + self._scale_interval()
        while True:
            poll = self.group.poll_segment(seg, self._poll_interval())
            if poll.failures:
                return Recovering(root_cause(poll.failures), poll.noticed_by)
            self._drain()
            self._check_interrupt()
            self.sizing.settle(len(self.workers), self.status)  # growth that waited too long is refused
            self.inbox.poll_mailbox(self.status())
            self.tracker.tick(self.group)
            if self.evacuation and self.evacuation.watch() and not self.inbox.has("notice"):
                self.post(Request("notice", reason="a node announced its end"))
            if poll.done:
                break
            if self.replanner.poll(self.steps.next_step, self.spec, self.group):
                self.group.request_stop()  # the closed loop changes the layout there
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._scale_interval()
                self._scale_check()
            if not stop_sent and self.inbox.waiting():
                self.group.request_stop(urgent=self.inbox.has("notice"))
                stop_sent = True
        self._segment = None
        self._drain()
        self.tracker.tick(self.group)
        assert poll.next_step is not None
        self.step = poll.next_step
        return AtBoundary(self.step)

    def _boundary(self, st: AtBoundary) -> State:
        """Scheduled switches, re-balancing, growth asked for, then requests one by one."""
        assert self.spec is not None and self.layouts is not None
        self.sizing.settle(len(self.workers), self.status)
        self._check_interrupt()
        if self.step >= self._end():
            return Finishing("stopped on request" if self._stop_at is not None else
                             "max_steps reached")
        if self._switch_done != self.step and not self.inbox.urgent():  # (a notice first)
            self._switch_done = self.step
            target = self.cfg.switch_at.get(self.step)
            if target is not None and target != self.spec.name:
                return Switching(target, f"switch_at {self.step}")
            change = self.replanner.change(self.step, self.spec, self.group)
            if change is not None:  # re-balanced shares, or the closed loop's new plan
                try:
                    self.layouts.apply(self.group, change[0], self.spec, reason=change[1])
                    self.spec = change[0]
                except SwitchError as e:
                    self._emit("switch_failed", f"{e}; training goes on as {self.spec.name}")
                    self.replanner.refused(change[1])
        while (req := self.inbox.take()) is not None:
            if (nxt := self._request(req)) is not None:
                return nxt
        return self._next_segment()

    def _request(self, req: Request) -> State | None:
        """Act on a request at a boundary: a state to carry it out, or None (answered)."""
        if req.kind == "switch":
            return Switching(str(req.value), req.reason, req)
        if req.kind == "grow":
            return Resizing(self.sizing.target, req.reason, warm_only=True, request=req)
        if req.kind == "scale":
            return self.sizing.ask(req, self.group, self._answer)
        if req.kind in ("notice", "evacuate"):
            assert self.evacuation is not None
            return self.evacuation.state_for(req, self._answer)
        if req.kind == "memory":
            self._answer(req, self.group.memory_counts(timeout_s=10))
        elif req.kind == "stop":
            self._emit("stopped", f"stopped on request at step {self.step}")
            self._stop_at = self.step
            self._answer(req, "stopped")
        return None

    def _switch(self, st: Switching) -> State:
        assert self.spec is not None and self.layouts is not None
        try:
            self.spec = self.layouts.switch(self.group, st.target, self.spec, st.reason)
            self._answer(st.request, self.spec.name)
        except SwitchError as e:  # the job goes on in the layout it has
            if st.request is None:
                self._emit("switch_failed", f"{e}; training goes on as {self.spec.name}",
                           data={"reason": st.reason})
            self._answer(st.request, e)
        return AtBoundary(self.step)

    def _resize(self, st: Resizing) -> State:
        assert self.regroup is not None
        with self.sizing.carrying(st.request):  # raises: the target as it was before
            out = self.regroup.resize(st.n, self._target_strategy(), st.warm_only, st.reason)
        if out is not None:
            self.spec, self.step = out.spec, out.step
        self._answer(st.request, len(self.workers))
        self.sizing.settle(len(self.workers), self.status)
        return AtBoundary(self.step)

    def _recover(self, st: Recovering) -> State:
        assert self.regroup is not None and self.spec is not None
        f = st.failure
        if getattr(f.error, "rollback", False) and f.step not in self._rolled_back:
            self._rolled_back.add(f.step)  # the same step again stops the job
            self._segment = None
            back = self.regroup.rollback(f, self.spec)
            if isinstance(back, GiveUp):
                return Failed(f.error or InfrastructureError(back.reason))
            self.step = back.step
            return AtBoundary(self.step)
        self.failures += 1
        seg, self._segment = self._segment, None
        out = self.regroup.recover(st.failure, self.failures, seg, self.spec,
                                   self._target_strategy(), self.sizing.after_loss(
                                       len(self.workers)), st.noticed_by)
        if isinstance(out, GiveUp):
            err = st.failure.error
            if st.failure.recoverable or not isinstance(err, BaseException):
                err = InfrastructureError(out.reason)
            return Failed(err)
        self.spec, self.step, self._switch_done = out.spec, out.step, -1  # (switch_at again)
        if self.evacuation is not None:
            self.evacuation.forget_gone()  # announced nodes that went before the boundary
        self._scale_check()  # replacements start now, in the background
        return AtBoundary(self.step)

    def _evacuate(self, st: Evacuating) -> State:
        assert self.evacuation is not None and self.spec is not None
        out = self.evacuation.run(self.spec, self.step, self._target_strategy())
        if isinstance(out, GiveUp):
            return Failed(InfrastructureError(out.reason))
        if out is not None:
            self.spec, self.step = out.spec, out.step
        self._answer(st.request, {"workers": len(self.workers), "step": self.step,
                                  "source": out.source if out else "nothing to move"})
        self._scale_check()  # a replacement, where there is room, joins later
        return AtBoundary(self.step)

    def _finish(self, st: Finishing) -> State:
        final = self.group.final_state()  # first: a loss in the upload wait costs a checkpoint
        last_checkpoint(self.tracker, self.group, self.spec if self._stop_at is not None
                        else None, self.step, self._emit)  # (stopped early: that step's too)
        done, unsaved = self.steps.next_step, unsaved_steps(self.events)  # (resumed: all)
        res = FitResult(final, self.history, self.events, self.sink.log.run_dir
                        if self.sink.log else self.cfg.run_path, unsaved=unsaved)
        return Finished(res, f"{done} steps ({st.reason}), final loss {res.final_loss:.4f}"
                        + (f"; {unsaved}" if unsaved else ""))

    # ------------------------------------------------------------------ helpers

    def _end(self) -> int:
        return min(self.cfg.max_steps, self._stop_at if self._stop_at is not None else 1 << 62)

    def _next_segment(self) -> State:
        if self.step >= self._end():
            return AtBoundary(self.step)
        assert self.layouts is not None
        return Running(self.step, self.layouts.segment_end(self.step, self._end(), self.group,
                                                           self.steps.hook.pause_after(self.step)))

    def _target_strategy(self) -> str:
        if self.cfg.strategy == "auto":
            return "auto"  # re-plan for the new membership
        return self.spec.name if self.spec else self.cfg.strategy

    def _scale_check(self) -> None:
        req = self.sizing.check(self.group)
        if req is not None:
            self.post(req)

    def _drain(self) -> None:
        """The workers' metrics into the step log (each step once), the tracker and the view."""
        assert self.spec is not None or not self.history
        stop = self.steps.ingest(self.workers, self.group.drain(), self.spec, self.generation,
                                 self.tracker.on_metric, self.replanner.on_metric)
        if stop and not self.inbox.has("stop"):
            self.post(Request("stop", reason="the on_step callback asked to stop"))
        self.steps.send_gate(self.group)
        if self.steps.fresh:
            self.steps.show_workers(self.group)

    def _poll_interval(self) -> float:
        below = len(self.workers) < self.sizing.target
        busy = (self.tracker.in_flight is not None or self.inbox.waiting() or below
                or bool(self.inbox.parked))
        last = float(self.history[-1].get("step_time") or 0.0) if self.history else None
        return min(self.steps.watch_s(), poll_interval(  # a watched step due: at its end
            busy=busy, last_step_s=last, checkpoint_every=self.cfg.checkpoint_every))

    def _scale_interval(self) -> float:
        return scale_interval(self.cfg.scale_check_s, len(self.workers) < self.sizing.target)

    # ------------------------------------------------------------------ outside

    def post(self, req: Request) -> None:
        """Thread-safe: queue a request for the next step boundary (a malformed one is
        answered at once with its error), and ask the workers to stop there now rather than
        at the controller's next poll."""
        if self.inbox.post(req) and self.phase is ControllerState.RUNNING and self.group:
            self.group.request_stop(urgent=req.kind == "notice")

    def _answer(self, req: Request | None, result: Any) -> None:
        self.inbox.answer(req, result, self.status())

    def status(self) -> dict[str, Any]:
        last = self.steps.last()
        done = last["step"] + 1 if last else self.step
        return {"job": self.cfg.job_name, "state": self.phase.value, "step": done,
                "max_steps": self.cfg.max_steps, "strategy": self.spec.name if self.spec else None,
                "world_size": len(self.workers), "loss": last.get("loss"),
                "samples_per_s": last.get("samples_per_s")}

    def _cleanup(self) -> None:
        try:
            if self.group is not None:
                self.group.close()
        finally:  # whatever the group's close did, nobody waits on a request for ever
            self.inbox.close(SwitchError(f"the job ended ({self.phase.value}) before the "
                                         "request was handled"), self.status())
        _ray_release(self.cfg, self._started_ray)


def _placed(infos: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The ``placed`` event: where the workers are, and which came warm from a pool."""
    warm = sum(1 for i in infos if i.get("warm"))
    return (f"{len(infos)} workers on {len({i['node_id'] for i in infos})} node(s), devices "
            f"{sorted({i['device_name'] for i in infos})}"
            + (f", {warm} warm from the pool" if warm else ""),
            {"warm": warm, "workers": [{"pid": i.get("pid"), "node_id": i.get("node_id"),
                                        "warm": bool(i.get("warm"))} for i in infos]})


def _begun(old: State, at: int | None) -> bool:
    """Whether a failure came from a step (a user's error names one) or later than the
    start's placing and forming (no step ran before those in this run)."""
    return at is not None or not isinstance(old, (Starting, Placing, Forming))


def _error_step(e: BaseException) -> int | None:
    """The step user code failed in (a ``failed`` event's step), None for other errors (a
    ``CheckpointCorruptError``'s step is the checkpoint's, not where the job was)."""
    return e.step if isinstance(e, WorkerError) else None


def _ray_connect(cfg: JobConfig, layouts: Layouts, emit: Callable[..., Any], pool: Any,
                 resume: tuple[Any, int] | None = None, own: Any = None) -> bool:
    """Attach to (or start) Ray, then run the job's Ray datasets into blocks (checked; the
    layouts checked again, as the sample's forward ran only now: ``check_layouts``);
    ``pool``: the job's ``WorkerPool`` (else the default one), which gives a pipeline a CPU.
    A Ray dataset's length is known only then: the planned ``resume`` (store, step; ``own``:
    the job's store) is checked against it again (``recheck_length``)."""
    from ..ray_connect import connect
    from ..ray_dataset import prepare
    from .pool import default_pool
    from .resume_checks import recheck_length

    unknown = cfg.dataset_length is None
    started = connect(cfg.ray_address, cfg.max_world * float(cfg.resources_per_worker.get(
        "CPU", 1)), lambda m: emit("cluster", m))
    try:  # (blocks a sweep ran once for its trials come in cfg.ray_blocks)
        cfg.ray_blocks = prepare(cfg, layouts.probe_model, emit, pool or default_pool())
        if cfg.dataset_format == "ray" and not chained(layouts.probe_model):
            check_layouts(cfg, layouts)  # (the sample just found its forward unchained)
        if unknown and resume is not None:
            recheck_length(resume, cfg, own, emit)
    except BaseException:
        _ray_release(cfg, started)
        raise
    return started


def _ray_release(cfg: JobConfig, started: bool) -> None:
    """Drop the job's Ray dataset blocks, and shut down the Ray this job started."""
    cfg.ray_blocks = {}
    if started:
        from ..ray_connect import disconnect

        disconnect()


def _ray_group(cfg: JobConfig, *, pool: Any = None) -> Any:
    if pool is None:  # the process's default pool, if one was made (WorkerPool.make_default)
        from .pool import default_pool

        pool = default_pool()
    from .worker_group import WorkerGroup

    if pool is None:
        return WorkerGroup(cfg, cfg.emulate)
    from .pooled import PooledPlacement

    return WorkerGroup(cfg, cfg.emulate, functools.partial(PooledPlacement, pool))


def _ray_mailbox(job: str) -> Any:
    from .mailbox import create

    return create(job)

