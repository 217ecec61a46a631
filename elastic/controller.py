"""The controller: an explicit state machine that places workers, forms the group, lays out the
strategy, lets the workers train, and acts at step boundaries (switches, checkpoints, failures).

It is not in the step path: workers run whole segments of steps; the controller polls their
metrics a few times a second and feeds the view and the run log.

This module holds the run loop, the steady state and the events; its other sections are
mixins, one module each (``_ctl_base`` says how they fit): placement and scaling, layouts and
switches, checkpoints, recovery.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strategies import StrategySpec

from ._ctl_base import ControllerState, WorkerRec, check_reachable, unwrap
from ._ctl_checkpoints import CheckpointMixin
from ._ctl_layout import LayoutMixin
from ._ctl_placement import PlacementMixin
from ._ctl_recovery import RecoveryMixin
from .config import JobConfig
from .data import share_bounds
from .errors import (
    ConfigError,
    ElasticError,
    InfrastructureError,
    SwitchError,
    WorkerError,
)
from .events import Event, RunLog
from .preflight import check_sample
from .reference import build_model
from .view import View

__all__ = ["Controller", "ControllerState", "FitResult", "Request"]

_POLL_S = 0.25  # while the controller has work at hand (see Controller._poll_interval)
_IDLE_POLL_S = 1.0  # otherwise: each poll is an RPC every worker answers, taking the GIL


@dataclass
class Request:
    """A request posted to a running controller (from the SDK handle, CLI or planner)."""

    kind: str  # "switch" | "stop" | "scale"
    value: Any = None
    reason: str = "requested"
    reply: queue.Queue[Any] | None = None
    remote_id: int | None = None  # set when the request came through the control actor


@dataclass
class FitResult:
    """What ``fit`` returns: final state, per-step history, events, and where logs are."""

    final_state: dict[str, Any]
    history: list[dict[str, Any]]
    events: list[Event]
    run_dir: str
    status: str = "finished"

    def state_dict(self) -> dict[str, Any]:
        """The final model parameters and buffers: FQN -> CPU tensor (plain PyTorch)."""
        return {k[len("model/"):]: v for k, v in self.final_state.items() if k.startswith("model/")}

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else float("nan")


class Controller(PlacementMixin, LayoutMixin, CheckpointMixin, RecoveryMixin):
    """Runs one job to completion. Owns its Ray workers and placement groups; owns Ray itself
    only when it started a local cluster. Not thread-safe except ``post``."""

    def __init__(self, config: JobConfig, view: View | None = None,
                 on_step: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """``on_step(entry)`` is called in the controller's thread for every completed step
        (the history entry); if it returns True the job stops at the next step boundary
        (an Optuna pruner uses this)."""
        config.validate()
        self.on_step = on_step
        self.cfg = config
        self.view = view or View()
        self.state = ControllerState.STARTING
        self.requests: queue.Queue[Request] = queue.Queue()
        self.events: list[Event] = []
        self.history: list[dict[str, Any]] = []
        self.workers: list[WorkerRec] = []
        self.generation = 0
        self.spec: StrategySpec | None = None
        self.step = 0
        self._started_ray = False
        self._next_worker_id = 0
        self._log: RunLog | None = None
        self._probe_model: Any = None
        self._use_gpu = False
        self._control: Any = None
        self.failures = 0
        self._free_slots: list[tuple[Any, int]] = []  # reserved bundles without a worker
        # workers starting in the background for room that appeared (warm spares): taken in
        # once up, so a scale-up pauses training only to form the group and hand over state
        self._warming: list[tuple[WorkerRec, Any]] = []
        self._speed: dict[int, float] = {}  # worker_id -> measured samples/s
        self._mem_at = 0.0
        self._used_speeds: list[float] | None = None  # the speeds the current shares follow
        self._running: list[tuple[WorkerRec, Any]] = []  # the segment's (worker, future)
        self._store: Any = None
        self._resume: tuple[Any, int] | None = None  # (store, step) to start from
        self._ckpt: dict[str, Any] | None = None  # the checkpoint in flight
        self._start_error = ""  # why the last worker that failed to start failed
        self._target_world = config.max_workers if config.max_workers is not None else \
            config.num_workers

    def post(self, req: Request) -> None:
        """Thread-safe: queue a request for the next step boundary, and ask the workers to
        stop there now rather than at the controller's next poll (up to 1 s away when idle)."""
        self.requests.put(req)
        if self.state is ControllerState.RUNNING:
            for w in list(self.workers):
                try:
                    w.handle.request_stop.remote()
                except Exception:  # a dead worker: failure handling sees it
                    pass

    def run(self) -> FitResult:
        cfg = self.cfg
        self._preflight()
        self._log = RunLog(cfg.run_path)
        self._log.write_config(cfg.to_dict())
        self.view.start(cfg.job_name, cfg.max_steps)
        try:
            self._connect()
            from . import control

            self._control = control.create(cfg.job_name)
            self._emit("start", f"job {cfg.job_name}: {cfg.max_steps} steps, global batch "
                       f"{cfg.global_batch_size}, {cfg.num_workers} workers, strategy {cfg.strategy}")
            self._place(cfg.num_workers)
            self._form_group()
            self._layout(self._make_spec(cfg.strategy, len(self.workers)), reason="start")
            if self._resume is not None:
                self._restore_from(*self._resume, reason="resume")
            self.state = ControllerState.RUNNING
            while self.step < cfg.max_steps:
                end = self._segment_end()
                try:
                    self.step = self._run_segment(self.step, end)
                    self._at_boundary()
                except InfrastructureError as e:
                    self._recover(e)
            self._finish_checkpoint()
            final = self._final_state()
            self.state = ControllerState.FINISHED
            last = self.history[-1]["loss"] if self.history else float("nan")
            self._emit("finished", f"{cfg.max_steps} steps, final loss {last:.4f}")
            return FitResult(final, self.history, self.events, cfg.run_path)
        except BaseException as e:
            self.state = ControllerState.FAILED
            if isinstance(e, ElasticError):
                self._emit("failed", str(e).splitlines()[0])
            raise
        finally:
            self._cleanup()
            self.view.close()
            if self._log:
                self._log.close()

    def _preflight(self) -> None:
        """Everything that can fail without Ray: build the model, look at the dataset."""
        cfg = self.cfg
        try:
            self._probe_model = build_model(cfg.model_factory(), cfg.seed)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError("model", f"the model factory raised {type(e).__name__}: {e}",
                              "fix the factory; it must return an nn.Module") from e
        ds = cfg.dataset_object()
        try:
            n = len(ds)
        except Exception as e:
            raise ConfigError("dataset", f"cannot read the dataset's length ({e}).",
                              "check the dataset URI or object") from e
        if n < cfg.global_batch_size:
            raise ConfigError(
                "dataset", f"has {n} samples, fewer than one global batch ({cfg.global_batch_size}).",
                f"use global_batch_size <= {n} or a larger dataset",
            )
        check_sample(cfg, self._probe_model, ds)  # the model and the loss on a few samples
        if cfg.eval_dataset is not None:
            try:
                n_eval = len(cfg.eval_dataset_object())
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError("eval_dataset", f"cannot read its length ({e}).",
                                  "check the dataset URI or object") from e
            if n_eval < 1:
                raise ConfigError("eval_dataset", "is empty.", "give it samples, or drop it")
        cfg.optimizer_factory()
        cfg.loss_fn()
        addr = cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if addr and addr not in ("local", "auto"):
            check_reachable(addr)
        if cfg.strategy != "auto":
            self._validate_spec(self._make_spec(cfg.strategy, cfg.num_workers), "strategy")
        if cfg.checkpoint_every > 0 or cfg.checkpoint_uri:
            from .checkpoint_io import job_store

            self._store = job_store(cfg)
            self._store.check_writable()
        if cfg.resume:
            self._resume = self._find_resume(cfg.resume)

    def _segment_end(self) -> int:
        ends = [self.cfg.max_steps]
        ends += [s for s in self.cfg.switch_at if s > self.step]
        every = self.cfg.rebalance_every
        if every > 0 and self.workers and self._balancing():
            ends.append((self.step // every + 1) * every)
        return min(ends)

    def _run_segment(self, start: int, end: int) -> int:
        import ray

        self.state = ControllerState.RUNNING
        futs = [w.handle.run.remote(start, end) for w in self.workers]
        self._running = list(zip(self.workers, futs, strict=True))
        stop_sent = False
        next_check = time.monotonic() + self._scale_interval()
        while True:
            done, pending = ray.wait(futs, num_returns=len(futs),
                                     timeout=self._poll_interval())
            if done and pending:
                self._raise_if_failed(done, pending)
            self._drain()
            self._poll_control()
            self._checkpoint_tick()
            if not pending:
                break
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._scale_interval()
                if self._warm_ready() and len(self.workers) < self._target_world:
                    self.post(Request("grow", reason="a node with room joined"))
                elif self._room_to_grow():
                    self._warm_up()
            if not stop_sent and not self.requests.empty():
                for w in self.workers:
                    w.handle.request_stop.remote()
                stop_sent = True
        try:
            results = ray.get(futs)
        except Exception:
            self._raise_if_failed(futs, [])
            raise
        self._drain()
        self._checkpoint_tick()
        return int(results[0]["next_step"])

    def _raise_if_failed(self, done: list[Any], pending: list[Any]) -> None:
        """If a finished segment failed, raise its root cause at once: a user error on one
        rank leaves its peers blocked in a collective, so waiting for them would only wait
        out the hang timeout."""
        import ray

        errors: list[BaseException] = []
        for f in done:
            try:
                ray.get(f)
            except Exception as e:
                errors.append(unwrap(e))
        if not errors:
            return
        if pending:  # give peers a moment to report a more specific cause
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for f in more:
                try:
                    ray.get(f)
                except Exception as e:
                    errors.append(unwrap(e))
        user = [e for e in errors if isinstance(e, WorkerError)]
        raise (user[0] if user else errors[0])

    def _drain(self) -> None:
        import ray

        batches: list[list[dict[str, Any]]] = []
        refs = [w.handle.drain.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        answered = set(ready)
        for ref in refs:
            if ref not in answered:  # a dead or stuck worker: failure handling takes over
                batches.append([])
                continue
            try:
                batches.append(ray.get(ref))
            except Exception as e:
                if isinstance(unwrap(e), WorkerError):
                    raise unwrap(e) from None
                batches.append([])
        per_step: dict[int, dict[str, Any]] = {}
        for w, batch in zip(self.workers, batches, strict=True):
            for m in batch:
                w.info["samples_per_s"] = m["samples"] / m["step_time"] if m["step_time"] else 0
                w.info["share"] = m["samples"]
                if m["step"] not in per_step or m["rank"] == 0:
                    per_step[m["step"]] = m
                if "checkpoint_begun" in m:
                    ck = self._ckpt
                    if ck is None or ck["step"] != m["checkpoint_begun"]:
                        ck = self._ckpt = {"step": m["checkpoint_begun"], "blocked_s": 0.0,
                                           "spec": self.spec, "t0": time.time()}
                    ck.setdefault("by_rank", {})[m["rank"]] = m["checkpoint_blocked_s"]
                    ck["blocked_s"] = max(ck["by_rank"].values())
                if m.get("checkpoint_wait_s"):  # the next update waited for the host copy
                    self._checkpoint_wait(m["rank"], float(m["checkpoint_wait_s"]))
                if m.get("checkpoint_skipped") and m["rank"] == 0:
                    self._emit("checkpoint_skipped", f"step {m['checkpoint_skipped']}: the "
                               "previous checkpoint is still uploading")
        for st in sorted(per_step):
            self._record_step(st, per_step[st])
        if per_step and time.monotonic() - self._mem_at > 2.0:  # memory column of the view
            self._mem_at = time.monotonic()
            refs = [w.handle.memory_counts.remote() for w in self.workers]
            for w, ref in zip(self.workers, refs, strict=True):
                try:
                    counts = ray.get(ref, timeout=10)
                    w.info["memory"] = {k: v * 4 for k, v in counts.items()}  # fp32 bytes
                except Exception:
                    pass
        if per_step:
            self.view.workers([w.info for w in self.workers])

    def _record_step(self, step: int, m: dict[str, Any] | None, spec: StrategySpec | None = None,
                     generation: int | None = None) -> None:
        """Record a completed step once: history, metrics log, view, and the data log line
        saying which rank trained which sample range of it (from the plan in force)."""
        spec = spec or self.spec
        assert spec is not None and self._log is not None
        if self.history and step <= self.history[-1]["step"]:
            return
        gen = m["generation"] if m else (generation or self.generation)
        entry = {"step": step, "loss": m["loss"] if m else float("nan"),
                 "samples_per_s": m["samples_per_s"] if m else 0.0,
                 "step_time": m["step_time"] if m else 0.0, "world_size": spec.world_size,
                 "strategy": spec.name, "time": m["time"] if m else time.time(),
                 "generation": gen}
        for key in ("lr", "grad_norm", "eval_loss"):  # lr_schedule, max_grad_norm, eval
            if m is not None and key in m:
                entry[key] = m[key]
        if m is None:
            entry["note"] = "completed while a worker was lost; its loss was not reported"
        self.history.append(entry)
        self._log.metric(entry)
        bounds = [share_bounds(spec.shares, r) for r in range(spec.world_size)]
        self._log.data({"step": step, "generation": gen, "ranges": bounds,
                        "global_samples": m["global_samples"] if m else None})
        self.view.step(entry)
        if self.on_step is not None and m is not None and self.on_step(entry) is True:
            if not any(r.kind == "stop" for r in list(self.requests.queue)):
                self.post(Request("stop", reason="the on_step callback asked to stop"))

    def _poll_control(self) -> None:
        """Publish status and take requests posted through the control actor."""
        if self._control is None:
            return
        import ray

        self._control.set_status.remote(self.status())
        try:
            taken = ray.get(self._control.take.remote(), timeout=10)
        except Exception as e:  # the mailbox is a convenience: losing it must not stop training
            self._emit("control_lost", f"the job's control actor failed ({type(e).__name__}); "
                       "remote control is off for this job, the SDK handle still works")
            self._control = None
            return
        for r in taken:
            self.post(Request(r["kind"], r["value"], r["reason"] or "requested remotely",
                              remote_id=r["id"]))

    def _at_boundary(self) -> None:
        if self.step >= self.cfg.max_steps:
            return
        if self.step in self.cfg.switch_at:
            try:
                self.switch(self.cfg.switch_at[self.step], reason=f"switch_at {self.step}")
            except SwitchError as e:  # the job goes on in the layout it has (see switch())
                self._emit("switch_failed", f"{e}; training goes on as {self.spec.name}"
                           if self.spec else str(e), data={"reason": f"switch_at {self.step}"})
        else:
            self._maybe_rebalance()
        while not self.requests.empty():
            req = self.requests.get_nowait()
            result: Any = None
            try:
                if req.kind == "switch":
                    self.switch(str(req.value), reason=req.reason)
                    result = self.spec.name if self.spec else None
                elif req.kind == "grow":
                    self._resize(self._target_world, reason=req.reason, warm_only=True)
                    result = len(self.workers)
                elif req.kind == "scale":
                    n = int(req.value)
                    if not self.cfg.min_world <= n <= self.cfg.max_world:
                        raise SwitchError(
                            f"cannot scale to {n} workers: outside min_workers..max_workers = "
                            f"{self.cfg.min_world}..{self.cfg.max_world}")
                    self._target_world = n
                    self._resize(n, reason=req.reason)
                    result = len(self.workers)
                elif req.kind == "memory":
                    import ray

                    result = ray.get([w.handle.memory_counts.remote() for w in self.workers])
                elif req.kind == "stop":
                    self._emit("stopped", f"stopped on request at step {self.step}")
                    self.cfg.max_steps = self.step
                    result = "stopped"
                else:
                    result = SwitchError(f"unknown request {req.kind!r}")
            except SwitchError as e:
                result = e
            if req.reply is not None:
                req.reply.put(result)
            if req.remote_id is not None and self._control is not None:
                out = {"error": str(result)} if isinstance(result, BaseException) else {
                    "ok": True, "result": result, "status": self.status()}
                self._control.reply.remote(req.remote_id, out)

    def _final_state(self) -> dict[str, Any]:
        import ray

        outs = ray.get([w.handle.full_state.remote(want=(w.rank == 0)) for w in self.workers])
        return outs[0]

    def _poll_interval(self) -> float:
        """Seconds between polls of a running segment. Each poll drains every worker's metrics
        by an RPC its second thread answers, taking the GIL from the training thread: at 4
        polls/s that cost ~7 % of a 2-core host's throughput (docs/benchmarks.md). So poll fast
        only while it matters: a checkpoint in flight (its commit rides on the poll), frequent
        checkpoints (under 5 s apart: a late commit would make the next one skip), a waiting
        request, the job below its target size, or before the first step is seen. Failures do
        not wait for a poll: ``ray.wait`` returns as soon as a segment ends."""
        if self._ckpt is not None or not self.requests.empty() or not self.history:
            return _POLL_S
        if len(self.workers) < self._target_world:
            return _POLL_S
        every = self.cfg.checkpoint_every
        step_s = float(self.history[-1].get("step_time") or 0.0)
        if every > 0 and every * step_s < 5.0:
            return _POLL_S
        return _IDLE_POLL_S

    def _emit(self, kind: str, message: str, data: dict[str, Any] | None = None,
              step: int | None = None) -> None:
        ev = Event(kind, self.cfg.redact(message), step=self.step if step is None else step,
                   data=self.cfg.redact_value(data or {}))
        self.events.append(ev)
        if self._log:
            self._log.event(ev)
        self.view.event(ev)

    def status(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        done = last["step"] + 1 if last else self.step
        return {"job": self.cfg.job_name, "state": self.state.value, "step": done,
                "max_steps": self.cfg.max_steps, "strategy": self.spec.name if self.spec else None,
                "world_size": len(self.workers), "loss": last.get("loss"),
                "samples_per_s": last.get("samples_per_s")}

    def _cleanup(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        warm = [w for w, _ in self._warming]
        self._warming = []
        for w in self.workers + warm:
            try:
                ray.kill(w.handle)
            except Exception:
                pass
        pgs = [w.pg for w in self.workers + warm] + [pg for pg, _ in self._free_slots]
        for pg in {id(pg): pg for pg in pgs if pg is not None}.values():
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        self.workers = []
        while not self.requests.empty():  # nobody is left to act on these
            req = self.requests.get_nowait()
            gone = SwitchError(f"the job ended ({self.state.value}) before the request was handled")
            if req.reply is not None:
                req.reply.put(gone)
            if req.remote_id is not None and self._control is not None:
                self._control.reply.remote(req.remote_id, {"error": str(gone)})
        if self._control is not None:
            try:  # let askers collect their replies (bounded) before the mailbox goes away
                self._control.set_status.remote(self.status())
                deadline = time.monotonic() + 3.0
                while ray.get(self._control.unread_replies.remote()) and time.monotonic() < deadline:
                    time.sleep(0.1)
                ray.kill(self._control)
            except Exception:
                pass
            self._control = None
        if self._started_ray:
            ray.shutdown()
