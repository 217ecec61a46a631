"""Membership changes: a new group over other workers, with the state carried over.

Two procedures end in the same place, a new generation of the group laid out for the
workers there are with the state restored: a *resize* at a step boundary (spares taken in,
or workers let go; every old rank first snapshots the full state, so every entry has a
holder) and a *recovery* after a failure (survivors keep their processes and memory; the
dead are dropped; replacements come from ready spares or placements, as
``clusters.policy.ScalingPolicy`` decides). Where the state comes from is
``clusters.policy.InPlaceRecovery``'s decision: live peers when every entry has a holder at
one step (no step lost), else the buddies' copies in the survivors' memory (a few steps run
again, no storage read), else the newest committed checkpoint that loads, else step 0.

``Regroup`` holds the components it drives and no state of its own.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clusters.policy import (
    Acquire,
    FailureBudget,
    FailureObservation,
    GiveUp,
    InPlaceRecovery,
    Proceed,
    RestoreObservation,
    ScalingObservation,
    ScalingPolicy,
)
from strategies import StrategySpec

from ..errors import HangError, InfrastructureError, StateMoveError, StorageError
from ..failures import Failure, FailureKind
from .checkpoints import CheckpointTracker, megabytes
from .layouts import Layouts
from .steps import StepLog

__all__ = ["Regroup", "Regrouped", "required_keys", "peer_plan", "roll_forward_ranks",
           "buddy_step"]

PeerPlan = list[tuple[str, int, tuple[int, ...], str]]  # (key, source rank, shape, dtype)


# --------------------------------------------------------------------------- pure helpers


def required_keys(model_keys: Sequence[str], param_names: Sequence[str],
                  held: Sequence[dict[str, Any]]) -> set[str]:
    """Every canonical key the state must have: the model's entries, plus each optimizer
    entry name seen on any holder for every parameter of ``param_names`` (the trainable ones:
    optimizers keep the same entries for all parameters once they have stepped, and none for
    a frozen one). A trainable parameter without state (one that never had a gradient) makes
    the state look incomplete: the restore then takes a checkpoint, never a state without
    an entry a lost rank held."""
    entries = {k.rpartition("/")[2] for h in held for k in h if k.startswith("optim/")}
    return {f"model/{k}" for k in model_keys} | {f"optim/{p}/{e}" for p in param_names
                                                  for e in entries}


def peer_plan(progress: Sequence[dict[str, Any]], held: Sequence[dict[str, Any]],
              required: set[str]) -> tuple[int, PeerPlan] | None:
    """The newest step that workers hold state at, and for every required key one holder
    at that step (lowest rank): ``(step, plan)``, or None when some key has no holder there."""
    steps = [p["next_step"] for p in progress if p["has_state"]]
    if not steps or not required:
        return None
    step = max(steps)
    plan: PeerPlan = []
    for key in sorted(required):
        src = next((r for r in range(len(progress))
                    if key in held[r] and progress[r]["next_step"] == step), None)
        if src is None:
            return None
        shape, dtype = held[src][key]
        plan.append((key, src, tuple(shape), dtype))
    return step, plan


def buddy_step(copies: Sequence[dict[str, Any]], required: set[str]) -> int | None:
    """The newest step at which the workers' snapshots and buddy copies (``copies``: each
    worker's ``copies_status``: ``{"steps": {step: [(key, full shape, rows or None)]}}``)
    hold every row of every ``required`` key; None when no step does (copies off, stale,
    or a rank lost with its buddy)."""
    steps = sorted({int(s) for c in copies for s in c.get("steps", {})}, reverse=True)
    for step in steps:
        spans: dict[str, list[tuple[int, int]]] = {}
        size: dict[str, int] = {}
        for c in copies:
            for key, shape, rows in c["steps"].get(step, ()):
                n = int(shape[0]) if len(shape) else 1
                size[key] = n
                spans.setdefault(key, []).append(tuple(rows) if rows is not None else (0, n))
        if required and all(k in size and _covers(spans[k], size[k]) for k in required):
            return step
    return None


def _covers(spans: list[tuple[int, int]], n: int) -> bool:
    at = 0
    for a, b in sorted(spans):
        if a > at:
            break
        at = max(at, b)
    return at >= n


def roll_forward_ranks(progress: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
    """Survivors that straddle two steps: if any applied step s (next step s + 1), those
    still at s with a pending update (their gradients were complete) can apply it without
    communication. Returns (their indices, s)."""
    top = max((p["next_step"] for p in progress), default=0)
    return [i for i, p in enumerate(progress)
            if p["next_step"] == top - 1 and p.get("pending_update")], top - 1


# --------------------------------------------------------------------------- procedures


@dataclass(frozen=True)
class Regrouped:
    """The outcome of a membership change: the new layout, the step training goes on from,
    where the state came from."""

    spec: StrategySpec
    step: int
    source: str
    detail: str


_RANK = re.compile(r"^rank \d+: ")


class Regroup:
    """Resizes and recoveries of one job (see the module docstring)."""

    def __init__(self, cfg: Any, group: Any, layouts: Layouts, tracker: CheckpointTracker,
                 steps: StepLog, emit: Callable[..., Any], drain: Callable[[], None]) -> None:
        self.cfg = cfg
        self.group = group
        self.layouts = layouts
        self.tracker = tracker
        self.steps = steps
        self._emit = emit
        self._drain = drain
        self.restore_policy = InPlaceRecovery()
        self.budget = FailureBudget(cfg.max_failures)
        self.scaling = ScalingPolicy(cfg.replacement_timeout_s, cfg.min_workers_timeout_s)
        self._last: tuple[tuple[object, ...], int] | None = None  # FailureObservation.repeats

    # ------------------------------------------------------------------ restore

    def restore(self, spec: StrategySpec, progress: list[dict[str, Any]],
                held: list[dict[str, Any]], cause: str) -> tuple[str, int, str]:
        """Lay ``spec`` out on the new group with the state from where the restore policy
        says; returns (source, step, detail)."""
        model = self.layouts.probe_model
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        need = (required_keys(list(model.state_dict()), trainable, held) if cause != "join"
                else {f"model/{k}" for k in model.state_dict()}  # a planned change: every
                | {k for h in held for k in h if k.startswith("optim/")})  # rank holds all
        peers = peer_plan(progress, held, need)
        position = max((p["next_step"] for p in progress if p["has_state"]), default=0)
        copies = self._copies() if peers is None and cause == "failure" else []
        buddy = buddy_step(copies, required_keys(
            list(model.state_dict()), trainable,
            list(held) + [{k: None for k, _, _ in c} for st in copies
                          for c in st["steps"].values()]))
        # the checkpoints are listed only when peers do not do (a storage that did not
        # answer held up every recovery, a resize's too)
        obs = RestoreObservation(position, peers[0] if peers else None, (), cause, buddy)
        decision = self.restore_policy.decide(obs)
        unlisted: StorageError | None = None
        if decision.source != "peers":
            try:
                steps = self.tracker.valid_steps()
            except StorageError as e:  # buddies need no storage: only they may go on
                steps, unlisted = (), e
            obs = dataclasses.replace(obs, checkpoints=steps)
            decision = self.restore_policy.decide(obs)
        steps = obs.checkpoints
        if decision.source == "peers" and peers is not None:
            outs = self.group.restore_from_peers(spec, peers[1], peers[0])
            return "peers", peers[0], f", {megabytes(outs[0]['bytes'])} MB from surviving replicas"
        if decision.source == "buddies":
            try:
                outs = self.group.restore_from_copies(spec, decision.step)
                mb = megabytes(sum(o.get("bytes_sent", 0) for o in outs))
                return "buddies", decision.step, (f", the buddies' copies of step "
                                                  f"{decision.step} ({mb} MB moved)")
            except StateMoveError as e:  # a corrupt copy: storage, as without copies
                self._emit("peer_copies_refused", f"{e}; restoring from storage instead",
                           data={"step": decision.step})
                decision = self.restore_policy.decide(dataclasses.replace(obs, buddy_step=None))
        if unlisted is not None and decision.source in ("checkpoint", "scratch"):
            raise unlisted  # never step 0 while the checkpoints may be intact
        if decision.source == "checkpoint":
            got = self.tracker.restore_newest(self.group, spec,
                                              tuple(s for s in steps if s <= decision.step))
            if got is not None:
                return "checkpoint", got[0], got[1]
        self.group.restart_fresh(spec)
        return "scratch", 0, " (no live replica of every entry and no checkpoint: restarted)"

    # ------------------------------------------------------------------ resize

    def resize(self, n: int, strategy: str, warm_only: bool, reason: str) -> Regrouped | None:
        """At a step boundary: grow by spares that are up (they get the state from their
        peers, never from storage) or shrink to ``n`` workers, keeping the trajectory. None
        when nothing changed (no spare was up)."""
        group = self.group
        t0 = time.time()
        old = list(group.workers)
        if n == len(old) or (n > len(old) and not group.spares_ready()):
            return None
        ck = self.tracker.settle(group, self.cfg.checkpoint_wait_s)  # this group commits it
        group.snapshot_full()  # every old rank holds it all
        progress, held = group.progress(), group.held_keys()
        if n > len(old):
            group.take_spares(n - len(old))
            if not warm_only and len(group.workers) < n:
                group.try_place(n - len(group.workers), 30.0)
            if len(group.workers) == len(old):
                return None
        else:
            group.shrink(n)
            progress, held = progress[:n], held[:n]
        group.leave([w for w in group.workers if w in old])
        self.form()
        spec = self.layouts.fit(strategy, len(group.workers), group)
        before = self.steps.next_step
        source, step, detail = self.restore(spec, progress, held, cause="join")
        if step != before:  # (a restore from elsewhere: the steps after it run again)
            self.steps.truncate(step)
        waited = "" if ck is None else (
            f"; waited {ck['seconds']:.1f}s for checkpoint {ck['step']} to "
            + ("commit" if ck["committed"] else "commit, then abandoned it"))
        self._emit("scaled", f"{len(old)} -> {len(group.workers)} workers ({reason}) in "
                   f"{time.time() - t0:.2f}s, state from {source}{detail}{waited}",
                   data={"from": len(old), "to": len(group.workers), "source": source,
                         "seconds": time.time() - t0, "strategy": spec.name,
                         "checkpoint_wait": ck})
        return Regrouped(spec, step, source, detail)

    # ------------------------------------------------------------------ recovery

    def _drain_kept(self) -> None:
        """The steps the ranks finished before a failure, into the history (were lost: no
        history, no metrics.jsonl, and the failure said where the controller last heard)."""
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the failure is handled whatever this did
            pass

    def recover(self, failure: Failure, failures: int, segment: Any, spec: StrategySpec,
                strategy: str, target: int, noticed_by: str = "") -> Regrouped | GiveUp:
        """Survive the loss of workers (``failures``: the job's count, this one included):
        keep the survivors' processes and memory, re-plan for the workers there are, restore
        the state, and say where training goes on; or the reason to give up."""
        group = self.group
        t_fail = time.time()
        if not failure.recoverable:  # user code, bad numbers, ...: the same again would fail
            self._drain_kept()
            self._emit("failure", f"{failure.kind.value} on rank {failure.rank}: "
                       f"{failure.message[:300]}", data={"kind": failure.kind.value,
                                                         "rank": failure.rank},
                       step=failure.step)
            return GiveUp(f"{failure.kind.value.replace('_', ' ')}: {failure.message}")
        if segment:  # a rank waiting for a slow upload's commit at a due checkpoint gives
            group.request_stop(urgent=True)  # it up (was: waited it out, its peers with it)
        hung = (group.wind_down(segment, self.steps.hang_wait_s(self.cfg.hang_timeout_s))
                if segment else [])
        if hung:
            self._emit("hang", f"rank(s) {[w.rank for w in hung]} did not leave their step "
                       f"within the group timeout ({self.cfg.hang_timeout_s:.0f}s): treated as "
                       "lost", data={"ranks": [w.rank for w in hung]})
            failure = Failure(FailureKind.HANG, f"rank(s) {[w.rank for w in hung]} hung",
                              rank=hung[0].rank, error=HangError("a rank hung in its step"))
        survivors, dead = group.survivors(exclude=hung)
        t_detect = time.time()
        self._drain_kept()  # the steps done before it, so the event says where it came
        lost_nodes = sorted({str(w.info.get("node_id", ""))[:8] for w in dead})
        self._emit("failure", f"{len(dead)} worker(s) lost (ranks {[w.rank for w in dead]}, "
                   f"node(s) {lost_nodes}); {len(survivors)} survive: {failure.message[:200]}",
                   data={"kind": failure.kind.value, "dead_ranks": [w.rank for w in dead],
                         "nodes": lost_nodes, "detect_s": t_detect - t_fail,
                         "noticed_by": noticed_by,
                         "survivor_pids": [w.info.get("pid") for w in survivors]})
        at = failure.step if failure.step is not None else self.steps.next_step
        # the same refusal by torch.distributed's own code (not a network, store or timeout
        # error: a degraded link repeats those too), whichever rank reported it first
        refused = not getattr(failure.error, "transport", True)
        same = (failure.kind, _RANK.sub("", failure.message), at) if refused else None
        repeats = (self._last[1] + 1 if same is not None and self._last is not None
                   and self._last[0] == same else 0)
        self._last = (same, repeats) if same is not None else None  # lost workers: the policy
        verdict = self.budget.decide(FailureObservation(
            failure.kind.value, True, failures, failure.message, lost=len(dead),
            repeats=repeats, step=at))
        if isinstance(verdict, GiveUp):
            return verdict
        group.remove(dead)
        self.tracker.abandon(group)
        self._roll_forward()
        group.leave()
        progress, held = group.progress(), group.held_keys()
        self._drain()  # metrics the survivors still had: steps done before the loss
        before = self.steps.next_step
        got = self.acquire(target)
        if isinstance(got, GiveUp):
            return got
        self.form()
        new_spec = self.layouts.fit(strategy, len(group.workers), group)
        source, step, detail = self.restore(new_spec, progress, held, cause="failure")
        self.steps.truncate(step)  # metrics after the restored position are void: run again
        for st in range(self.steps.next_step, step):  # steps the state holds but nobody
            self.steps.record(st, None, spec, group.generation - 1)  # could report
        took = time.time() - t_fail
        lost = max(0, before - step)
        self._emit("recovered", f"from {source} in {took:.2f}s at step {step} on "
                   f"{len(group.workers)} workers ({new_spec.name}); {lost} step(s) lost{detail}",
                   data={"source": source, "seconds": took, "steps_lost": lost,
                         "detect_s": t_detect - t_fail, "world_size": len(group.workers),
                         "strategy": new_spec.name, "pids": [w.info.get("pid")
                                                             for w in group.workers]})
        return Regrouped(new_spec, step, source, detail)

    def rollback(self, failure: Failure, spec: StrategySpec) -> Regrouped | GiveUp:
        """``on_nonfinite: rollback``: a step's loss or gradient was not finite on the live
        group (every worker raised at the same step, the group is intact): restore the newest
        committed checkpoint before that step on the same workers and go on from there. A
        checkpoint is never committed with non-finite state, so it is finite. The caller
        refuses a second rollback for the same step (the data would bring it back)."""
        bad = failure.step if failure.step is not None else 1 << 62
        self._drain()  # steps done before the bad one, then void past the checkpoint
        # a checkpoint still uploading (of a step before the bad one: a state with NaN in it
        # is never committed) commits first: it may be the one to go back to
        self.tracker.finish(self.group, self.cfg.checkpoint_wait_s, "the rollback")
        got = self.tracker.restore_newest(self.group, spec,
                                          tuple(s for s in self.tracker.valid_steps() if s <= bad))
        if got is None:
            return GiveUp(f"{failure.message}; no committed checkpoint before step {bad} to "
                          "roll back to. Fix: take checkpoints (checkpoint_every), or set "
                          "on_nonfinite: skip")
        step, detail = got
        self.steps.truncate(step)
        self._emit("rolled_back", f"non-finite loss or gradient at step {bad}: back to "
                   f"checkpoint step {step}{detail}", data={"from": bad, "to": step})
        return Regrouped(spec, step, "checkpoint", detail)

    def _copies(self) -> list[dict[str, Any]]:
        """The survivors' buddy copies (none when the job keeps none)."""
        if getattr(self.cfg, "peer_copies_every", 0) <= 0:
            return []
        try:
            return self.group.copies_status()
        except InfrastructureError:
            return []

    def _roll_forward(self) -> None:
        """A step's final all-reduce can complete on some ranks and fail on others: if any
        survivor applied step s, those still at s with complete gradients apply theirs, so
        every entry has a live holder at s + 1 again."""
        try:
            progress = self.group.progress(timeout_s=30)
        except InfrastructureError:  # a survivor that cannot answer: seen when regrouping
            return
        idx, s = roll_forward_ranks(progress)
        if idx:
            ws = [self.group.workers[i] for i in idx]
            self.group.finish_pending_step(ws)
            self._emit("rolled_forward", f"rank(s) {[w.rank for w in ws]} applied step {s}'s "
                       "update, which peers had applied when the node was lost",
                       data={"ranks": [w.rank for w in ws], "step": s})

    def acquire(self, target: int) -> Proceed | GiveUp:
        """Replacements as the scaling policy decides: ready spares, placements within the
        replacement timeout, and below ``min_workers`` a bounded wait."""
        group, cfg = self.group, self.cfg
        for phase in ("recovery", "recovered", "waited"):
            d = self.scaling.decide(ScalingObservation(
                phase, len(group.workers), target, cfg.min_world, cfg.max_world,
                spares_ready=group.spares_ready(), spares_starting=group.spares_starting()))
            if isinstance(d, (Proceed, GiveUp)):
                return d
            assert isinstance(d, Acquire)
            if phase == "recovered":
                self._emit("waiting", f"{len(group.workers)} workers < min_workers="
                           f"{cfg.min_world}; waiting up to {d.wait_s:.0f}s")
            joined = group.take_spares(d.take) + group.try_place(d.place, d.wait_s)
            if joined:
                self._emit("joined", f"{len(joined)} worker(s) taken in on node(s) "
                           f"{sorted({str(w.info.get('node_id'))[:8] for w in joined})}")
        return Proceed()

    def form(self) -> None:
        addr, port, secs = self.group.form()
        self.tracker.formed(self.group.generation)  # an earlier group's checkpoints: void
        self._emit("group", f"generation {self.group.generation}: {len(self.group.workers)} "
                   f"ranks via {addr}:{port} in {secs:.2f}s")
