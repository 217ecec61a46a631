"""What a job does about nodes that will go away at a known time (a preemption notice or a
maintenance drain): ``EvacuationPolicy``, pure, run by the live controller and the simulator
alike. Part of the policies of ``clusters.policy``, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVACUATION_PATHS", "EvacuationObservation", "Evacuate", "EvacuationPolicy"]


# --------------------------------------------------------------------------- evacuation


EVACUATION_PATHS = ("replace", "move", "checkpoint", "recover")


@dataclass(frozen=True)
class EvacuationObservation:
    """Nodes hosting some of the job's workers will go away (a preemption notice, or a drain
    asked for maintenance), seen at a step boundary.

    ``deadline_s``: seconds left until they go (None: no deadline). ``move_s``: how long the
    draining nodes are still needed to hand their state to the survivors (the measured
    bandwidth times the bytes only they hold; 0 when every piece they hold has a live replica
    elsewhere). ``checkpoint_s``: how long writing their shards to the job's checkpoint
    store takes (measured from the job's uploads; None: the job has no store).
    ``survivors``: workers on the other nodes; ``fits``: the planner found a layout of the
    state that the survivors' memory holds. ``peer_copies``: buddies' copies cover the
    draining ranks (recovering after letting them go reads no storage).
    ``replace_wait_s``: the longest the job may wait for replacements placed elsewhere
    while the draining nodes still hold their state (the job's ``min_workers_timeout_s`` at
    the notice; at the boundary what that wait has left; 0: none). ``replacements_ready``:
    replacements up now. ``boundary_s``: how long reaching the next step boundary may take
    once a wait ends (the live controller's drain poll)."""

    deadline_s: float | None
    move_s: float
    checkpoint_s: float | None
    survivors: int
    min_workers: int
    fits: bool = True
    peer_copies: bool = False
    replace_wait_s: float = 0.0
    replacements_ready: int = 0
    boundary_s: float = 0.0


@dataclass(frozen=True)
class Evacuate:
    """How to evacuate: ``"move"`` the draining ranks' state onto the survivors now (no step
    lost, no storage); ``"checkpoint"`` the state, release the draining workers, then recover
    from that checkpoint (no step lost; a storage write and read); ``"recover"``: release them
    now and recover as from a loss (peers' copies or the last checkpoint: steps may be run
    again); ``"replace"``: the survivors alone are too few: place replacements first, for
    up to ``wait_s``, taking them in while the draining ranks still hold their state, then
    decide again (a move onto them, no step lost). ``reason`` says why, with the figures
    compared."""

    path: str
    reason: str
    wait_s: float = 0.0


@dataclass(frozen=True)
class EvacuationPolicy:
    """Move the state when the survivors can hold it (``fits``, at least ``min_workers``)
    and the move ends ``slack_s`` before the deadline with its measured cost taken
    ``margin`` times; else the fastest path that is still safe: a checkpoint when it ends
    in time (taken ``margin`` times too: nothing lost), else letting the node go now (the
    job recovers from peers' copies or the last checkpoint, rather than losing the node in
    the middle of a step at the deadline).

    Survivors fewer than ``min_workers`` first ask for replacements (``replace``) while
    there is time to wait for one and still either move onto it (two transfers: the
    newcomers' state, then the hand-off) or checkpoint if none comes, each ``margin`` times,
    with ``slack_s`` more to reach the step boundary when the wait ends.
    Was: the node was let go at once and the job stopped, below ``min_workers``, until a
    replacement came after the node had gone, or ended when none came within
    ``min_workers_timeout_s``."""

    margin: float = 2.0
    slack_s: float = 1.0

    def decide(self, obs: EvacuationObservation) -> Evacuate:
        left = float("inf") if obs.deadline_s is None else obs.deadline_s - self.slack_s
        when = ("no deadline" if obs.deadline_s is None else
                f"{obs.deadline_s:.1f}s left, {self.slack_s:.1f}s kept in reserve")
        move_t = obs.move_s * self.margin
        short = obs.survivors < max(1, obs.min_workers)
        if short and (obs.replace_wait_s > 0 or obs.replacements_ready):
            # the newcomers' state, then the hand-off, or (none came, or the move no longer
            # fits once they joined) a checkpoint after it
            reserve = move_t + max(move_t, (obs.checkpoint_s or 0.0) * self.margin)
            spare = left - reserve - self.slack_s - obs.boundary_s
            wait = max(0.0, min(obs.replace_wait_s, spare))
            if spare >= 0 and (wait > 0 or obs.replacements_ready):
                how = (f"taking the {obs.replacements_ready} up" if not wait else
                       f"waiting up to {wait:.1f}s")
                return Evacuate("replace", f"{obs.survivors} worker(s) would be left, fewer "
                                f"than min_workers={obs.min_workers}: replacements first, "
                                f"{how} ({when}; {reserve:.2f}s kept to move the state onto "
                                f"them, or to checkpoint if none comes, and "
                                f"{self.slack_s + obs.boundary_s:.1f}s to reach the step "
                                "boundary)", wait_s=wait)
        if obs.survivors < max(1, obs.min_workers):
            why = (f"{obs.survivors} worker(s) would be left, fewer than min_workers="
                   f"{obs.min_workers}")
        elif not obs.fits:
            why = "the survivors' memory cannot hold the state in any layout the planner knows"
        elif move_t <= left:
            return Evacuate("move", f"moving the state takes ~{obs.move_s:.2f}s "
                            f"(x{self.margin:g} = {move_t:.2f}s; {when})")
        else:
            why = f"moving the state takes ~{obs.move_s:.2f}s (x{self.margin:g}), more than {when}"
        if obs.checkpoint_s is not None and obs.checkpoint_s * self.margin <= left:
            return Evacuate("checkpoint", f"{why}; a checkpoint takes ~{obs.checkpoint_s:.2f}s "
                            f"(x{self.margin:g}): checkpoint, then recover from it")
        source = "the buddies' copies" if obs.peer_copies else "the last checkpoint"
        ck = ("no checkpoint store" if obs.checkpoint_s is None else
              f"a checkpoint takes ~{obs.checkpoint_s:.2f}s (x{self.margin:g}), too long")
        return Evacuate("recover", f"{why}; {ck}: the node is let go now and the job "
                        f"recovers from {source}")
