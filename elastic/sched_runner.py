"""How the live scheduler runs a job in its own process: a ``Controller`` in a thread, and
its ``scale``/``stop`` requests posted to it (answered at the job's next step boundary).

The same as ``elastic.submit``'s ``JobHandle``, without the SDK module (the scheduler's actor
module is reached from the SDK, so it must not import it back)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from .control import Controller, FitResult, Request
from .view import View

__all__ = ["ControllerRunner", "RunningJob"]


class RunningJob:
    """One job's controller, running in a background thread of this process."""

    def __init__(self, cfg: Any, hook: Any = None, pool: Any = None) -> None:
        self.controller = Controller(cfg, View(), hook=hook, pool=pool)
        self.hook = hook
        self.result_: FitResult | None = None
        self.error: BaseException | None = None
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

    def ask(self, kind: str, value: Any, reason: str, timeout: float) -> Any:
        req = Request(kind, value, reason)
        req.reply = queue.Queue()
        self.controller.post(req)
        out = req.reply.get(timeout=timeout)
        if isinstance(out, BaseException):
            raise out
        return out


class ControllerRunner:
    """The scheduler core's ``Runner``: each job a ``RunningJob`` in this process;
    ``hooks``: job name -> its ``StepHook`` (a sweep trial's pruner); ``pool``: a
    ``WorkerPool`` of this process its workers come from, when there is one."""

    def __init__(self, hooks: dict[str, Any] | None = None, pool: Any = None) -> None:
        self.hooks = hooks if hooks is not None else {}
        self.pool = pool

    def start(self, name: str, cfg: Any, workers: int) -> RunningJob:
        return RunningJob(cfg.replace(view="none"), self.hooks.pop(name, None), self.pool)

    def scale(self, handle: RunningJob, workers: int) -> int:
        return int(handle.ask("scale", workers, "the scheduler's decision", 300.0))

    def status(self, handle: RunningJob) -> dict[str, Any]:
        return dict(handle.controller.status())

    def done(self, handle: RunningJob) -> bool:
        return not handle.thread.is_alive()

    def result(self, handle: RunningJob) -> FitResult:
        handle.thread.join(60)
        if handle.error is not None:
            raise handle.error
        if handle.result_ is None:
            raise TimeoutError("the job is still running")
        return handle.result_

    def stop(self, handle: RunningJob) -> None:
        handle.ask("stop", None, "cancelled in the scheduler's queue", 300.0)
