"""How the live scheduler runs a job in its own process: a ``Controller`` in a thread, and
its ``scale``/``stop`` requests posted to it (answered at the job's next step boundary).

The same as ``elastic.submit``'s ``JobHandle``, without the SDK module (the scheduler's actor
module is reached from the SDK, so it must not import it back)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .control import Controller, FitResult, Request
from .control.requests import ask
from .view import View

__all__ = ["ControllerRunner", "RunningJob", "REPLY_S"]

REPLY_S = 300.0  # how long a scale request's answer is waited for


class RunningJob:
    """One job's controller, running in a background thread of this process."""

    def __init__(self, cfg: Any, hook: Any = None, pool: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_end: Callable[[], Any] | None = None) -> None:
        self.controller = Controller(cfg, View(), hook=hook, pool=pool)
        self.hook = hook
        self.clock = clock
        self.on_end = on_end
        self.result_: FitResult | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._main, name=f"elastic-job-{cfg.job_name}",
                                       daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.result_ = self.controller.run()
            if self.hook is not None:
                self.hook.finish()  # a pruner's hook: the values it has not reported yet
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
            self.error = e
        finally:
            self.ended_at = self.clock()
            if self.on_end is not None:
                self.on_end()  # the scheduler decides at once: its workers are free

    def ask(self, kind: str, value: Any, reason: str, timeout: float) -> Any:
        return ask(self.controller, Request(kind, value, reason), timeout)  # (a timeout
        # was "refused: " and nothing)


class ControllerRunner:
    """The scheduler core's ``Runner``: each job a ``RunningJob`` in this process;
    ``hooks``: job name -> its ``StepHook`` (a sweep trial's pruner); ``pool``: a
    ``WorkerPool`` of this process its workers come from, when there is one; ``clock``: the
    scheduler's (a job's end is stamped with it); ``on_end``: called in the job's thread as
    it ends (the scheduler's loop wakes, rather than notice it at its next round)."""

    def __init__(self, hooks: dict[str, Any] | None = None, pool: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_end: Callable[[], Any] | None = None) -> None:
        self.hooks = hooks if hooks is not None else {}
        self.pool = pool
        self.clock = clock
        self.on_end = on_end

    def start(self, name: str, cfg: Any, workers: int) -> RunningJob:
        return RunningJob(cfg.replace(view="none"), self.hooks.pop(name, None), self.pool,
                          self.clock, self.on_end)

    def scale(self, handle: RunningJob, workers: int) -> int:
        return int(handle.ask("scale", workers, "the scheduler's decision", REPLY_S))

    def status(self, handle: RunningJob) -> dict[str, Any]:
        return dict(handle.controller.status())

    def done(self, handle: RunningJob) -> bool:
        # ended_at is set (after the result) before on_end wakes the loop, while the thread
        # is still alive: the woken loop must see the job done
        return handle.ended_at is not None or not handle.thread.is_alive()

    def result(self, handle: RunningJob) -> FitResult:
        handle.thread.join(60)
        if handle.error is not None:
            raise handle.error
        if handle.result_ is None:
            raise TimeoutError("the job is still running")
        return handle.result_

    def ended_at(self, handle: RunningJob) -> float | None:
        return handle.ended_at

    def partial(self, handle: RunningJob) -> tuple[list[dict[str, Any]], str | None]:
        ctl = handle.controller
        log = ctl.sink.log  # (None: it failed before its run directory was made)
        return list(ctl.history), log.run_dir if log is not None else None

    def stop(self, handle: RunningJob) -> None:
        """Posted, not waited for: the scheduler's loop reaps the job once it has ended. Was:
        the tick waited for the answer (a job still placing held every job's tick up to
        300 s)."""
        handle.controller.post(Request("stop", None, "cancelled in the scheduler's queue"))
