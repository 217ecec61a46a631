"""The public SDK: ``fit`` runs a job to completion; ``submit`` returns a handle to a running one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, overload

from .config import JobConfig
from .control import Controller, FitResult, Request
from .control.requests import ask
from .view import View, make_view

__all__ = ["fit", "submit", "JobHandle"]


def _config(config: JobConfig | dict[str, Any] | str | None, overrides: dict[str, Any]) -> JobConfig:
    """One checked config from ``config`` (a JobConfig, a mapping of settings, or a YAML path)
    with ``overrides`` winning; either may use the flat or the nested form."""
    if config is None:
        return JobConfig.from_dict(overrides)
    if isinstance(config, str):
        return JobConfig.from_yaml(config, overrides)
    if isinstance(config, dict):
        return JobConfig.from_dict(config, overrides)
    return config.replace(**overrides)  # a copy: what the job derives (its name, run
    # directory, dataset length) stays off the caller's object, which may be run again


def fit(config: JobConfig | dict[str, Any] | str | None = None, *, display: View | None = None,
        on_step: Callable[[dict[str, Any]], Any] | None = None, pool: Any = None,
        **fields: Any) -> FitResult:
    """Train a job to completion and return its result.

    ``config`` is a ``JobConfig``, a dict of its fields, or a YAML path; keyword arguments
    set or override fields (``fit(model=..., optimizer=..., ...)`` works without a config).
    Raises ``ConfigError`` before any worker starts for bad settings, ``WorkerError`` with the
    worker's rank and traceback when user code fails, ``ClusterError`` when Ray cannot host it.
    ``pool``: an ``elastic.WorkerPool`` whose warm workers the job takes and gives back.
    """
    cfg = _config(config, fields)
    ctl = Controller(cfg, display or make_view(cfg.view, cfg.log_every), on_step=on_step,
                     pool=pool)
    return ctl.run()


class JobHandle:
    """A job running in a background thread of this process. Thread-safe."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._result: FitResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="elastic-controller", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._result = self.controller.run()
        except BaseException as e:
            self._error = e

    def _ask(self, req: Request, timeout: float | None) -> Any:
        return ask(self.controller, req, timeout)

    def switch(self, strategy: str, reason: str = "requested by the SDK",
               timeout: float | None = 300) -> str:
        """Switch the running job to ``strategy`` at the next step boundary; returns its name.
        Raises ``SwitchError`` if refused (the job keeps running in its old layout)."""
        return self._ask(Request("switch", strategy, reason), timeout)

    def scale(self, workers: int, timeout: float | None = 300) -> int:
        """Grow or shrink the running job to ``workers`` (within min..max workers) at the
        next step boundary; new workers get the state from their peers. Returns the count."""
        return self._ask(Request("scale", workers, reason="requested by the SDK"), timeout)

    def evacuate(self, node_id: str, deadline_s: float | None = None,
                 timeout: float | None = 300) -> dict[str, Any]:
        """Empty node ``node_id`` (a prefix of its id will do) for maintenance: Ray is asked
        to drain it (nothing new lands there; ``deadline_s``: when it will go, None: no
        deadline), and at the next step boundary its workers' state moves onto the others
        and they are released, as for a preemption notice. Returns ``{"workers", "step",
        "source"}``; raises ``SwitchError`` when no node of the job matches."""
        return self._ask(Request("evacuate", {"node": node_id, "deadline_s": deadline_s},
                                 reason="maintenance drain requested by the SDK"), timeout)

    def stop(self, timeout: float | None = 300) -> Any:
        return self._ask(Request("stop", reason="requested by the SDK"), timeout)

    def status(self) -> dict[str, Any]:
        return self.controller.status()

    def controller_memory(self, timeout: float | None = 300) -> list[dict[str, int]]:
        """Per rank, the elements each worker actually holds (params, grads, optim), read at
        the next step boundary."""
        return self._ask(Request("memory", reason="memory query"), timeout)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> FitResult:
        self._thread.join(timeout)
        if self._thread.is_alive():  # what it is doing, and what it said last
            try:
                st = self.status()
                last = [f"{e.kind} (step {e.step}): {e.message[:160]}"
                        for e in list(self.controller.events)[-5:]]
            except Exception as e:  # noqa: BLE001 - the status itself failed: say so
                st, last = {"status": f"unavailable: {type(e).__name__}: {e}"}, []
            raise TimeoutError(f"the job is still running after {timeout}s: {st}; its last "
                               f"events: {last}")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@overload
def submit(config: JobConfig | dict[str, Any] | str | None = None, *, display: View | None = None,
           on_step: Callable[[dict[str, Any]], Any] | None = None, scheduler: None = None,
           pool: Any = None, **fields: Any) -> JobHandle: ...


@overload
def submit(config: JobConfig | dict[str, Any] | str | None = None, *, display: View | None = None,
           on_step: Callable[[dict[str, Any]], Any] | None = None, scheduler: str,
           pool: None = None, **fields: Any) -> Any: ...


def submit(config: JobConfig | dict[str, Any] | str | None = None, *, display: View | None = None,
           on_step: Callable[[dict[str, Any]], Any] | None = None, scheduler: str | None = None,
           pool: Any = None, **fields: Any) -> Any:
    """Start a job in the background and return a ``JobHandle`` (switch, stop, status, result).

    With ``scheduler=NAME`` the job is queued in the running elastic scheduler of that name
    instead (``elastic scheduler start``): it decides when the job starts and how many workers
    it has; returns a ``ScheduledJob`` (status, cancel, result). ``pool``: an
    ``elastic.WorkerPool`` whose warm workers the job takes and gives back (a scheduler has
    its own: ``elastic scheduler start --warm N``)."""
    cfg = _config(config, fields)
    if scheduler is not None:
        if display is not None or on_step is not None or pool is not None:
            raise ValueError("a scheduled job runs in the scheduler's process: display, "
                             "on_step and pool cannot be given with scheduler=")
        from .scheduler import submit_to

        return submit_to(scheduler, cfg)
    return JobHandle(Controller(cfg, display or make_view(cfg.view, cfg.log_every),
                                on_step=on_step, pool=pool))
