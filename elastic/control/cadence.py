"""How often the controller looks at a running segment: pure functions of what it knows.

Each poll drains every worker's metrics by an RPC its second thread answers, taking the GIL
from the training thread: at 4 polls/s that cost ~7 % of a 2-core host's throughput
(docs/benchmarks.md at 2d38cfc, Overhead, 2026-11-30). So the controller polls fast only while it matters; failures do not
wait for a poll (a segment's end wakes it at once).
"""

from __future__ import annotations

__all__ = ["POLL_S", "IDLE_POLL_S", "poll_interval", "scale_interval"]

POLL_S = 0.25  # while the controller has work at hand
IDLE_POLL_S = 1.0  # otherwise


def poll_interval(*, busy: bool, last_step_s: float | None, checkpoint_every: int) -> float:
    """Seconds between polls. ``busy``: a checkpoint in flight, a request waiting, growth
    under way or the job below its target size; ``last_step_s``: the last step's time (None
    before the first step is seen); checkpoints under 5 s apart need fast commits (a late
    commit makes the next one skip)."""
    if busy or last_step_s is None:
        return POLL_S
    if checkpoint_every > 0 and checkpoint_every * last_step_s < 5.0:
        return POLL_S
    return IDLE_POLL_S


def scale_interval(scale_check_s: float, below_target: bool) -> float:
    """Seconds between checks for room: ``scale_check_s``, at most 1 s while the job is below
    its target size (after a loss the replacement node usually comes within seconds; the
    check is one GCS call)."""
    return min(1.0, scale_check_s) if below_target else scale_check_s
