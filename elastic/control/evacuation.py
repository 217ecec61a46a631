"""Evacuation: a node that will go away at a known time (a cloud's preemption notice, or a
drain asked for maintenance) is emptied at the next step boundary, while the job goes on.

Notices: while training, the worker group's ``notices()`` (Ray's draining nodes that host the
job's workers: one GCS call, every ``drain_poll_s``) are watched; a new one is an
``preemption_notice`` event naming the node, its ranks and the time left, and the workers are
asked to stop at the next step boundary. A drain asked through ``job.evacuate(node)`` or
``elastic drain JOB NODE`` is handed to Ray's own drain (so nothing new lands there) and
becomes a ``maintenance`` notice at once.

At the boundary, ``clusters.policy.EvacuationPolicy`` decides from the time left, the measured
cost of moving what only the draining ranks hold, the cost of a checkpoint, and whether the
survivors can hold the state (the planner, under their memory):

* ``move``: the draining ranks hand their pieces to survivors (``hand_off``, checked), every
  worker parks its state, the draining workers are released (long before the deadline), the
  survivors form a new group and load the (re-planned) layout from the pieces with the live
  reshard's move, checked as a switch is. No step lost, no checkpoint read, no survivor
  restarted;
* ``checkpoint``: the state is checkpointed and committed, the draining workers released,
  and the survivors recover from that checkpoint (no step lost);
* ``recover``: the draining workers are released now and the job recovers as after a loss
  (the buddies' copies, or the last checkpoint).

The ``evacuated`` event says which path, why, and what it cost.

When the survivors alone would be fewer than ``min_workers``, the policy first says
``replace``: at the notice, replacements start in the background where there is room (a node
that joins meanwhile counts; Ray places nothing new on a draining node) and training goes
on; at the boundary after they are up (or once the wait the policy gave is over) they are
taken in as in a resize, their state from their peers, while the draining ranks still hold
theirs; the policy then decides again, now a ``move`` onto them. None up in time: a
``replacement_missing`` event and the paths above, with the time for a checkpoint kept. The
job briefly runs with one group more than ``max_workers`` (the replacements beside the
draining workers) until the move lets those go.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from clusters.policy import Evacuate, EvacuationObservation, EvacuationPolicy, GiveUp
from strategies import StrategySpec

from ..errors import CheckpointError, InfrastructureError, StateMoveError, SwitchError
from .checkpoints import CheckpointTracker
from .group import DrainNotice, WorkerRec
from .layouts import Layouts, replicas_stay
from .regroup import Regroup, Regrouped
from .requests import Request
from .states import Evacuating

__all__ = ["Evacuation", "resolve_node"]

DEFAULT_BANDWIDTH = 100e6  # bytes/s until a hand-off or a switch measured one
FIXED_S = 0.05  # a hand-off's fixed part: two small all_gathers and an agreement
RETRY_S = 5.0  # while replacements are waited for, how often more are asked for


def resolve_node(wanted: str, nodes: list[str]) -> str:
    """The node id among ``nodes`` that ``wanted`` names (a prefix of its hex id, as events
    print it); ``SwitchError`` naming the job's nodes when none or several match."""
    hits = sorted({n for n in nodes if n.startswith(wanted.strip())}) if wanted.strip() else []
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(sorted({n[:12] for n in nodes})) or "none"
    raise SwitchError(f"{'no' if not hits else 'more than one'} node of this job matches "
                      f"{wanted!r} (the job's nodes: {known}). Fix: give a longer prefix of "
                      "the node id (`elastic status JOB`, or ray list nodes)")


class Evacuation:
    """Notices and evacuations of one job. Owns the notices seen and not yet acted on, and
    the measured transfer bandwidth that prices the next move."""

    def __init__(self, cfg: Any, group: Any, layouts: Layouts, tracker: CheckpointTracker,
                 regroup: Regroup, emit: Callable[..., Any],
                 steps_done: Callable[[], int], replace_to: Callable[[int], int]) -> None:
        self.cfg = cfg
        # the size replacements are placed up to, from the size the job had (Sizing's)
        self._replace_to = replace_to
        self.group = group
        self.layouts = layouts
        self.tracker = tracker
        self.regroup = regroup
        self._emit = emit
        self._steps_done = steps_done  # a notice's event is at the steps done when seen
        self.policy = EvacuationPolicy(cfg.evacuation_margin, cfg.evacuation_slack_s)
        self.pending: dict[str, DrainNotice] = {}  # node -> notice, not acted on yet
        # node evacuated -> the workers it hosted then: a later sighting of the node's drain
        # is news only for a worker placed there since (a hand drain Ray refused lets one land)
        self.done: dict[str, frozenset[int]] = {}
        self.bandwidth = DEFAULT_BANDWIDTH
        self._next_poll = 0.0
        # survivors too few: replacements start at the notice and training goes on until
        # they are up, or until this (monotonic) time (``_hold``); None: act at the boundary
        self._until: float | None = None
        self._need = 0
        self._retry = 0.0  # when replacements are asked for again while held

    # ------------------------------------------------------------------ notices

    def watch(self, now: float | None = None) -> bool:
        """While training, at most every ``drain_poll_s``: take new notices of draining
        nodes hosting the job's workers (each one an event). Returns whether a notice is
        waiting for the next step boundary."""
        t = time.monotonic() if now is None else now
        if not self.cfg.watch_drains or t < self._next_poll:
            return self._due()
        self._next_poll = t + self.cfg.drain_poll_s
        for n in self.group.notices():
            if n.node_id not in self.pending and not self._hosts(n.node_id) <= self.done.get(
                    n.node_id, frozenset()):
                self._take(n, self._steps_done())
        if self._until is not None and t >= self._retry:  # a node with room may have joined
            self._retry = t + RETRY_S  # (not at every poll: a start may wait 1 s for room)
            self.group.start_spares(self._need - self.group.spares_starting())
        return self._due()

    def _due(self) -> bool:
        """A notice waits for the boundary: none held, or its replacements are up, or the
        time to wait for them is over."""
        if not self.pending:
            return False
        return (self._until is None or time.monotonic() >= self._until
                or self.group.spares_ready() >= self._need)

    def _hosts(self, node: str) -> frozenset[int]:
        """The ids of the job's workers on ``node`` now."""
        return frozenset(w.worker_id for w in self.group.workers
                         if str(w.info.get("node_id", "")) == node)

    def _take(self, n: DrainNotice, step: int | None = None, by_hand: bool = False) -> None:
        self.pending[n.node_id] = n
        left = n.left_s(time.time())
        when = "no deadline" if left is None else f"{left:.1f}s left"
        held = self._hold()
        then = ("evacuating at the next step boundary" if not held else
                "replacements first, waited for at the step boundary" if by_hand else
                "replacements first, training goes on until they are up")
        self._emit("preemption_notice", f"node {n.node_id[:8]} ({n.reason}) hosting rank(s) "
                   f"{list(n.ranks)} will go: {when}; {then}",
                   data={"node": n.node_id, "ranks": list(n.ranks), "reason": n.reason,
                         "message": n.message, "deadline": n.deadline, "left_s": left},
                   step=step)
        if held:
            self._emit("replacing", f"{self._need} replacement(s) asked for: {held.reason}",
                       data={"need": self._need, "wait_s": held.wait_s,
                             "starting": self.group.spares_starting()}, step=step)

    def _hold(self) -> Evacuate | None:
        """Survivors fewer than ``min_workers``: where the policy says ``replace``, start the
        replacements now, in the background, and go on training until they are up (or the
        time it gives runs out); the boundary then takes them in and moves the state onto
        them. Was: the node was let go at the next boundary and the job stopped, below
        ``min_workers``, until a replacement came after the node had gone."""
        stay = [w for w in self.group.workers
                if str(w.info.get("node_id", "")) not in self.pending]
        if len(stay) >= self.cfg.min_world:
            return None
        now = time.time()  # every pending node counts: the first deadline, all their ranks
        lefts = [n.deadline - now for n in self.pending.values() if n.deadline is not None]
        d = self.policy.decide(EvacuationObservation(
            min(lefts) if lefts else None, self._move_guess(len(stay)), self._checkpoint_s(),
            len(stay), self.cfg.min_world, True, self.cfg.peer_copies_every > 0,
            self.cfg.min_workers_timeout_s, boundary_s=self.cfg.drain_poll_s))
        if d.path != "replace":
            self._until = None  # no time to wait (for this notice, or with it): act now
            return None
        until = time.monotonic() + d.wait_s
        self._until = until if self._until is None else min(self._until, until)
        self._need = self._wanted(stay)
        self.group.start_spares(self._need - self.group.spares_starting())
        self._retry = time.monotonic() + RETRY_S
        return d

    def _wanted(self, stay: list[WorkerRec]) -> int:
        """Replacements for the draining workers: back to the size the job had (as after a
        loss), at least to ``min_workers``."""
        return max(self.cfg.min_world, self._replace_to(len(stay))) - len(stay)

    def request(self, req: Request) -> bool:
        """``job.evacuate(node)`` / ``elastic drain JOB NODE``: drain the node through Ray
        (nothing new lands there) and evacuate it now. Returns False when refused (answered
        by the caller with the ``SwitchError`` raised)."""
        value = req.value or {}
        nodes = [str(w.info.get("node_id", "")) for w in self.group.workers]
        node = resolve_node(str(value.get("node", "")), nodes)
        deadline_s = value.get("deadline_s")
        why = self.group.drain_node(node, deadline_s, f"maintenance: {req.reason}")
        if why:
            self._emit("drain_refused", f"Ray refused to drain node {node[:8]}: {why}; "
                       "evacuating it anyway", data={"node": node, "why": why})
        ranks = tuple(w.rank for w in self.group.workers if w.info.get("node_id") == node)
        self.done.pop(node, None)
        self._take(DrainNotice(node, ranks, None if deadline_s is None else
                               time.time() + float(deadline_s), "maintenance", req.reason,
                               time.time()), by_hand=True)
        return True

    def state_for(self, req: Request, answer: Callable[[Request, Any], None]
                  ) -> Evacuating | None:
        """At a step boundary, a ``notice`` (the watch saw one) or an ``evacuate`` request:
        the state that carries it out, or None (refused and answered)."""
        if req.kind == "evacuate":
            try:
                self.request(req)
            except SwitchError as e:
                answer(req, e)
                return None
            return Evacuating(req.reason, req)
        return Evacuating()

    def forget_gone(self) -> list[DrainNotice]:
        """After a loss: the notices whose nodes no longer host a worker (the node went
        before the step boundary came); returned, and dropped."""
        hosts = {str(w.info.get("node_id", "")) for w in self.group.workers}
        gone = [n for node, n in self.pending.items() if node not in hosts]
        if gone and len(gone) == len(self.pending):
            self._until = None  # nothing held any more
        for n in gone:
            self.pending.pop(n.node_id, None)
            self.done[n.node_id] = frozenset()
            self._emit("preemption_missed", f"node {n.node_id[:8]} went before the next step "
                       f"boundary ({time.time() - n.seen:.1f}s after its notice); the job "
                       "recovered as after a loss", data={"node": n.node_id,
                                                         "ranks": list(n.ranks)})
        return gone

    # ------------------------------------------------------------------ at the boundary

    def run(self, spec: StrategySpec, step: int, strategy: str) -> Regrouped | GiveUp | None:
        """Evacuate every pending node (see the module docstring). None when no worker was
        on them any more."""
        notices, self.pending = list(self.pending.values()), {}
        nodes = {n.node_id for n in notices}
        self.done.update((node, self._hosts(node)) for node in nodes)
        # the time the notice's hold left to wait for replacements (once: none when it gave
        # none, or on a retry after a failure)
        until, self._until = self._until, None
        wait_s = 0.0 if until is None else max(0.0, until - time.monotonic())
        if until is not None and not wait_s and self.group.spares_ready() < self._need:
            self._missing(nodes, "none was up within the wait of the notice", 0.0)
        try:
            return self._run(spec, step, strategy, notices, nodes, wait_s)
        except BaseException:
            # a failure on the way (a peer lost in the hand-off): the recovery keeps the
            # draining workers, which live; their notices wait for the next boundary again
            hosts = {str(w.info.get("node_id", "")) for w in self.group.workers}
            for n in notices:
                if n.node_id in hosts:
                    self.pending.setdefault(n.node_id, n)
                    self.done.pop(n.node_id, None)
            raise

    def _run(self, spec: StrategySpec, step: int, strategy: str, notices: list[DrainNotice],
             nodes: set[str], wait_s: float) -> Regrouped | GiveUp | None:
        group = self.group
        leaving = [w for w in group.workers if str(w.info.get("node_id", "")) in nodes]
        if not leaving:
            return None
        self.tracker.tick(group)  # an upload still in flight needs the draining workers:
        self.tracker.abandon(group)  # given up; the checkpoint path takes one
        t0 = time.time()
        ready = group.spares_ready()  # (once: replacements up now)
        while True:
            leaving = [w for w in group.workers if str(w.info.get("node_id", "")) in nodes]
            stay = [w for w in group.workers if w not in leaving]
            now = time.time()
            lefts = [n.deadline - now for n in notices if n.deadline is not None]
            left = min(lefts) if lefts else None
            fits, target, why_plan = self._plan(stay, strategy)
            decision = self.policy.decide(EvacuationObservation(
                left, self._move_s(spec, leaving), self._checkpoint_s(), len(stay),
                self.cfg.min_world, fits, self.cfg.peer_copies_every > 0, wait_s, ready,
                self.cfg.drain_poll_s))
            ranks = [w.rank for w in leaving]
            names = sorted(n[:8] for n in nodes)
            self._emit("evacuating", f"node(s) {names} (rank(s) {ranks}): {decision.path}, "
                       f"{decision.reason}{why_plan}",
                       data={"nodes": sorted(nodes), "ranks": ranks, "path": decision.path,
                             "reason": decision.reason, "left_s": left})
            if decision.path != "replace":
                break
            wait_s, ready = 0.0, 0
            spec, step = self._replace(spec, step, strategy, stay, names, decision.wait_s)
        if decision.path == "move":
            try:
                return self._move(spec, step, target, leaving, notices, left, t0)
            except StateMoveError as e:
                self._emit("evacuation_failed", f"{e}; letting the node go and recovering")
                return self._let_go(spec, step, target, leaving, notices, t0, "recover")
        if decision.path == "checkpoint":
            return self._checkpoint(spec, step, target, leaving, notices, left, t0)
        return self._let_go(spec, step, target, leaving, notices, t0, "recover")

    def _replace(self, spec: StrategySpec, step: int, strategy: str, stay: list[WorkerRec],
                 names: list[str], wait_s: float) -> tuple[StrategySpec, int]:
        """Grow by replacements (spares up, or started where there is room and up within
        ``wait_s``: never on a draining node, which Ray schedules nothing new on) while the
        draining ranks still hold their state; they join as in a resize (state from their
        peers). The layout and step to evacuate from next: the new group's, or the same when
        none came (said)."""
        group = self.group
        need = self._wanted(stay)
        end, retry = time.monotonic() + wait_s, 0.0
        while group.spares_ready() < need and time.monotonic() < end:
            if time.monotonic() >= retry:  # where there is room (a start may wait 1 s)
                retry = time.monotonic() + 2.0
                group.start_spares(need - group.spares_starting())
            time.sleep(0.25)
        # (the group beside the draining workers: each rank needs a sample of the batch)
        room = self.cfg.global_batch_size - len(group.workers)
        ready = min(need, group.spares_ready(), room)
        got = (self.regroup.resize(len(group.workers) + ready, strategy, warm_only=True,
                                   reason=f"replacing node(s) {names} before they go")
               if ready > 0 else None)
        if got is None:
            self._missing(names, f"the global batch ({self.cfg.global_batch_size}) has no "
                          f"sample for a worker beside the {len(group.workers)}" if room <= 0
                          else f"none was up within {wait_s:.1f}s", wait_s)
            return spec, step
        return got.spec, got.step

    def _missing(self, nodes: Any, why: str, wait_s: float) -> None:
        self._emit("replacement_missing", f"no replacement for node(s) "
                   f"{sorted(n[:8] for n in nodes)}: {why}", data={"wait_s": wait_s})

    def _move(self, spec: StrategySpec, step: int, strategy: str, leaving: list[WorkerRec],
              notices: list[DrainNotice], left: float | None, t0: float
              ) -> Regrouped | GiveUp:
        group = self.group
        handed = group.hand_off([w.rank for w in leaving])
        moved = sum(o["bytes_received"] for o in handed)
        t_hand = max(o["seconds"] for o in handed)
        if moved and t_hand > 0:
            self.bandwidth = max(1e6, moved / t_hand)
        group.leave([w for w in group.workers if w not in leaving], collect=False)
        group.release(leaving)
        released = time.time()
        self.regroup.form()
        new_spec = self.layouts.fit(strategy, len(group.workers), group)
        try:
            outs = group.restore_from_pieces(new_spec, step)
        except StateMoveError as e:  # the survivors still hold what they parked
            self._emit("evacuation_failed", f"{e}; restoring as after a loss")
            return self._restored(new_spec, step, leaving, notices, t0, "recover")
        pause = time.time() - t0
        sent = sum(o.get("bytes_sent", 0) for o in outs)
        before = {o.get("hash_before") for o in outs}
        same = before == {o.get("hash_after") for o in outs} and len(before) == 1
        until = None if left is None else left - (released - t0)
        self._emit("evacuated", f"node(s) {sorted(n.node_id[:8] for n in notices)} evacuated at "
                   f"step {step} by moving the state: {moved / 1e6:.2f} MB handed off in "
                   f"{t_hand:.2f}s, workers released {released - t0:.2f}s after the boundary"
                   + ("" if until is None else f" ({until:.1f}s before the deadline)")
                   + f"; training paused {pause:.2f}s; {new_spec.name} on "
                   f"{len(group.workers)} workers, {sent / 1e6:.2f} MB resharded, "
                   f"{'state unchanged (every piece checked)' if same else 'CHECK FAILED'}; "
                   "0 steps lost, no checkpoint read, no survivor restarted",
                   data={"path": "move", "nodes": sorted(n.node_id for n in notices),
                         "ranks": [w.rank for w in leaving], "step": step, "steps_lost": 0,
                         "pause_s": pause, "hand_off_s": t_hand, "handed_bytes": moved,
                         "released_s": released - t0, "left_at_release_s": until,
                         "resharded_bytes": sent, "state_preserved": same,
                         "strategy": new_spec.name, "world_size": len(group.workers),
                         "pids": [w.info.get("pid") for w in group.workers]})
        return Regrouped(new_spec, step, "evacuation", "")

    def _checkpoint(self, spec: StrategySpec, step: int, strategy: str,
                    leaving: list[WorkerRec], notices: list[DrainNotice], left: float | None,
                    t0: float) -> Regrouped | GiveUp:
        budget = 300.0 if left is None else max(0.1, left - self.cfg.evacuation_slack_s)
        try:
            self.tracker.final(self.group, spec, step)
            self.tracker.finish(self.group, timeout_s=budget)
        except (CheckpointError, InfrastructureError) as e:
            self._emit("evacuation_failed", f"the checkpoint failed ({e}); letting the node go")
        return self._let_go(spec, step, strategy, leaving, notices, t0, "checkpoint")

    def _let_go(self, spec: StrategySpec, step: int, strategy: str, leaving: list[WorkerRec],
                notices: list[DrainNotice], t0: float, path: str) -> Regrouped | GiveUp:
        group = self.group
        group.leave()
        group.release(leaving)
        return self._restored(spec, step, leaving, notices, t0, path, strategy)

    def _restored(self, spec: StrategySpec, step: int, leaving: list[WorkerRec],
                  notices: list[DrainNotice], t0: float, path: str,
                  strategy: str | None = None) -> Regrouped | GiveUp:
        """The draining workers are gone and the survivors have left their group: recover as
        after a loss (peers, buddies' copies, checkpoint), with replacements as the scaling
        policy says."""
        group = self.group
        progress, held = group.progress(), group.held_keys()
        got = self.regroup.acquire(self._replace_to(len(group.workers)))
        if isinstance(got, GiveUp):
            return got
        self.regroup.form()
        new_spec = self.layouts.fit(strategy or spec.name, len(group.workers), group)
        source, at, detail = self.regroup.restore(new_spec, progress, held, cause="failure")
        lost = max(0, step - at)
        self.regroup.steps.truncate(at)
        self._emit("evacuated", f"node(s) {sorted(n.node_id[:8] for n in notices)} evacuated at "
                   f"step {step} ({path}): state from {source} at step {at}{detail}; "
                   f"training paused {time.time() - t0:.2f}s; {lost} step(s) to run again",
                   data={"path": path, "nodes": sorted(n.node_id for n in notices),
                         "ranks": [w.rank for w in leaving], "step": step, "source": source,
                         "steps_lost": lost, "pause_s": time.time() - t0,
                         "strategy": new_spec.name, "world_size": len(group.workers),
                         "pids": [w.info.get("pid") for w in group.workers]})
        return Regrouped(new_spec, at, source, detail)

    # ------------------------------------------------------------------ what it costs

    def _plan(self, stay: list[WorkerRec], strategy: str) -> tuple[bool, str, str]:
        """Whether the survivors can hold the state (the planner, under their memory), the
        strategy to lay it out as, and a few words when it changes."""
        if not stay:
            return False, strategy, ""
        return self.layouts.survivor_plan(strategy, [w.info for w in stay])

    def _move_s(self, spec: StrategySpec, leaving: list[WorkerRec]) -> float:
        """The hand-off's cost: what only the draining ranks hold (nothing when a replica
        survives every loss of one node), at the measured bandwidth."""
        if replicas_stay(spec, {w.rank for w in leaving}):
            return FIXED_S
        try:
            counts = self.group.memory_counts(timeout_s=10)
        except InfrastructureError:
            return FIXED_S + 1e9 / self.bandwidth
        idx = {w.rank for w in leaving}
        elems = sum(c.get("params", 0) + c.get("optim", 0) for r, c in enumerate(counts)
                    if r in idx)
        return FIXED_S + 4.0 * elems / self.bandwidth

    def _move_guess(self, stay: int) -> float:
        """A hand-off's cost guessed without asking the workers (they are training): the
        draining ranks' share of the parameters and Adam's two moments, as a sharded layout
        holds them, at the measured bandwidth."""
        model = self.layouts.probe_model
        n = sum(p.numel() for p in model.parameters()) if model is not None else 0
        world = max(1, len(self.group.workers))
        return FIXED_S + 12.0 * n * (world - stay) / world / self.bandwidth

    def _checkpoint_s(self) -> float | None:
        """The last committed checkpoint's upload and commit time (None: no store)."""
        if self.tracker.store is None:
            return None
        last = self.tracker.last_event
        if last is not None and "seconds" in last.data:
            return float(last.data["seconds"])
        return 2.0  # none taken yet: a cautious guess

