"""``Estimate``: the cost model's prediction of one plan's step (time parts and memory)."""

from __future__ import annotations

from dataclasses import dataclass

from .memory import MemoryBreakdown

__all__ = ["Estimate"]


@dataclass(frozen=True)
class Estimate:
    """Predicted step of a plan. Times in seconds, memory per rank (``memory[rank]``).

    ``memory_use``: the largest ``memory[rank].total`` / usable bytes of that rank's device,
    first reached at ``tightest_rank`` (above 1.0 the plan does not fit)."""

    step_time: float
    compute: float
    comm: float
    optimizer: float
    bubble: float
    memory: tuple[MemoryBreakdown, ...]
    link: str = ""
    memory_use: float = 0.0
    tightest_rank: int = 0

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)
