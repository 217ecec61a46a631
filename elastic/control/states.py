"""The controller's states: one small record each, carrying only what its next step needs.

``Controller.run`` is ``while not state.terminal: state = controller.step(state)``; each
record's ``phase`` is what ``status()`` and the live view show, and every transition is
emitted as a ``state`` event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..failures import Failure
from .requests import Request

__all__ = [
    "ControllerState",
    "State",
    "Starting",
    "Placing",
    "Forming",
    "Running",
    "AtBoundary",
    "Switching",
    "Resizing",
    "Recovering",
    "Evacuating",
    "Finishing",
    "Finished",
    "Failed",
    "FitResult",
]


class ControllerState(enum.Enum):
    """The phase a job is in (``status()["state"]``)."""

    STARTING = "starting"
    PLACING = "placing"
    FORMING = "forming"
    RUNNING = "running"
    AT_BOUNDARY = "at_boundary"
    SWITCHING = "switching"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    EVACUATING = "evacuating"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.FAILED)


@dataclass(frozen=True)
class State:
    """Base of the state records."""

    phase: ClassVar[ControllerState]

    @property
    def terminal(self) -> bool:
        return self.phase.terminal

    def describe(self) -> str:
        """A few words for the transition event."""
        return self.phase.value


@dataclass(frozen=True)
class Starting(State):
    """Before anything: check the job, connect, claim its name."""

    phase: ClassVar[ControllerState] = ControllerState.STARTING


@dataclass(frozen=True)
class Placing(State):
    """Reserve ``n`` workers and start them."""

    phase: ClassVar[ControllerState] = ControllerState.PLACING
    n: int


@dataclass(frozen=True)
class Forming(State):
    """Form the first group, lay the strategy out, restore a checkpoint to resume from."""

    phase: ClassVar[ControllerState] = ControllerState.FORMING


@dataclass(frozen=True)
class Running(State):
    """Train steps ``start`` up to ``end`` (exclusive) on every worker."""

    phase: ClassVar[ControllerState] = ControllerState.RUNNING
    start: int
    end: int

    def describe(self) -> str:
        return f"running steps {self.start}..{self.end - 1}"


@dataclass(frozen=True)
class AtBoundary(State):
    """Every worker stopped after ``step - 1``: act on schedules, requests and checks."""

    phase: ClassVar[ControllerState] = ControllerState.AT_BOUNDARY
    step: int

    def describe(self) -> str:
        return f"at the boundary before step {self.step}"


@dataclass(frozen=True)
class Switching(State):
    """Move the live state into strategy ``target``."""

    phase: ClassVar[ControllerState] = ControllerState.SWITCHING
    target: str
    reason: str
    request: Request | None = field(default=None, compare=False)

    def describe(self) -> str:
        return f"switching to {self.target} ({self.reason})"


@dataclass(frozen=True)
class Resizing(State):
    """Change the group to ``n`` workers (``warm_only``: only by spares already up)."""

    phase: ClassVar[ControllerState] = ControllerState.RESIZING
    n: int
    reason: str
    warm_only: bool = False
    request: Request | None = field(default=None, compare=False)

    def describe(self) -> str:
        if self.warm_only:  # (as many as are up: "scaled 2 -> 3" may follow, not 4)
            return f"resizing toward {self.n} workers with the spares up ({self.reason})"
        return f"resizing to {self.n} workers ({self.reason})"


@dataclass(frozen=True)
class Recovering(State):
    """Survive ``failure``: survivors keep their processes, a new group restores the state."""

    phase: ClassVar[ControllerState] = ControllerState.RECOVERING
    failure: Failure
    noticed_by: str = ""  # the first signal: liveness, collective or actor

    def describe(self) -> str:
        return f"recovering from {self.failure.kind.value}"


@dataclass(frozen=True)
class Evacuating(State):
    """Empty the nodes that announced their end (``Evacuation.pending``) at this step
    boundary: move their state onto the survivors, or the fastest safe path."""

    phase: ClassVar[ControllerState] = ControllerState.EVACUATING
    reason: str = "preemption notice"
    request: Request | None = field(default=None, compare=False)

    def describe(self) -> str:
        return f"evacuating ({self.reason})"


@dataclass(frozen=True)
class Finishing(State):
    """The last step is done (or the job was stopped): commit the last checkpoint, collect
    the final state."""

    phase: ClassVar[ControllerState] = ControllerState.FINISHING
    reason: str = "max_steps reached"


@dataclass
class FitResult:
    """What ``fit`` returns: final state, per-step history, events, and where logs are."""

    final_state: dict[str, Any]
    history: list[dict[str, Any]]
    events: list[Event]
    run_dir: str
    status: str = "finished"
    # a job whose checkpoints failed after its newest committed one (the last one's storage
    # gone): what is not in any checkpoint (its final state holds it), else None
    unsaved: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """The final model parameters and buffers: FQN -> CPU tensor (plain PyTorch)."""
        return {k[len("model/"):]: v for k, v in self.final_state.items() if k.startswith("model/")}

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else float("nan")


@dataclass(frozen=True)
class Finished(State):
    phase: ClassVar[ControllerState] = ControllerState.FINISHED
    result: FitResult = field(compare=False)
    message: str = ""


@dataclass(frozen=True)
class Failed(State):
    phase: ClassVar[ControllerState] = ControllerState.FAILED
    error: BaseException = field(compare=False)

    def describe(self) -> str:
        return f"failed: {str(self.error).splitlines()[0][:200] if str(self.error) else ''}"
