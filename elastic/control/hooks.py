"""What watches a job's steps from the driver's side, beyond a plain ``on_step``.

A ``StepHook`` is handed to a job's controller (``Controller(hook=...)``, or with the job to
an elastic scheduler, which runs the controller in its own process: then the hook must
pickle). A sweep trial's pruner is one (``elastic.sweep.trial_steps``). Every method has a
do-nothing default, so a hook overrides only what it uses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepHook"]


class StepHook:
    """The controller's calls on a hook, all on its own thread."""

    def on_step(self, entry: dict[str, Any]) -> bool:
        """Each completed step's history entry, in order; True stops the job at the next
        step boundary."""
        return False

    def watch_at(self, step: int) -> int | None:
        """The first step >= ``step`` whose entry ``on_step`` wants as soon as it exists
        (the controller's polls are paced to its end: ``StepLog.watch_s``)."""
        return None

    def pause_after(self, step: int) -> int | None:
        """The first step >= ``step`` after which the workers wait for ``on_step``'s answer
        (a segment ends there)."""
        return None

    def gate(self, next_step: int) -> Any:
        """A decision for the workers to apply themselves at a step >= ``next_step``
        (``clusters.sweep_policy.PruneGate``), or None."""
        return None

    def open_soon(self) -> Any:
        """Called when a scheduler queues the job: prepare in the background (a sweep's
        study opened before the job's first step)."""
        return None

    def finish(self) -> None:
        """Called once after the job ends, whatever its end."""
