"""The controller's checkpoints: the one in flight, its commit, retention, and restores.

``CheckpointTracker`` owns the job's checkpoint store and the checkpoint in flight. The
workers decide together, at a step boundary, to take one (each writes its shard in the
background); the tracker learns of it from their metrics, polls the uploads and commits the
manifest once every shard is in, then applies retention (``clusters.policy.RetentionPolicy``).
A failed upload is an event, never a crash. Restores (resume, and the fallback of a
recovery) take the newest committed checkpoint that verifies, falling back past a corrupt one
with an event naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from strategies import StrategySpec

from ..checkpoint import (
    CheckpointMeta,
    CheckpointStore,
    apply_retention,
    commit,
    committed_steps,
)
from ..errors import (
    CheckpointError,
    CheckpointOwnerError,
    ConfigError,
    InfrastructureError,
    StorageError,
)
from .resume_checks import check_claimed, model_unlike, refuse_newer, sampling_changed

__all__ = ["CheckpointTracker", "spec_dict", "read_detail"]

Emit = Callable[..., Any]


def spec_dict(spec: StrategySpec) -> dict[str, Any]:
    """A spec as JSON-able data (events, manifests)."""
    return spec.to_dict()


def megabytes(n_bytes: float) -> str:
    """``n_bytes`` in MB for an event: one decimal from 1 MB up, three digits below (a small
    model's was "0.0 MB" moved, read, committed)."""
    v = n_bytes / 1e6
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}" if v >= 1e-3 or v == 0 else "<0.001"


def read_detail(outs: list[dict[str, Any]]) -> str:
    """What each worker read of a checkpoint: only its new shard's part of the state."""
    if not outs:
        return ""
    got = [o["bytes"] for o in outs]
    return (f" (each worker read {megabytes(min(got))}-{megabytes(max(got))} of "
            f"{megabytes(outs[0]['total_bytes'])} MB)")


class CheckpointTracker:
    """Checkpoints of one job. ``store`` is None when the job takes none."""

    def __init__(self, cfg: Any, store: CheckpointStore | None, emit: Emit) -> None:
        self.cfg = cfg
        self.store = store
        self._emit = emit
        # A checkpoint is named by (gen, seq): the group generation that began it and how many
        # that group had begun (all its ranks begin each one together), so a name never comes
        # again, also when a restore repeats a step. in_flight: step, gen, seq, spec, t0,
        # blocked_s, by_rank
        self.in_flight: dict[str, Any] | None = None
        self.last_event: Any = None  # the last "checkpoint" event (late waits are added to it)
        self._last_id: tuple[Any, Any] = (None, None)  # the name of that one
        self.bad_steps: set[int] = set()  # committed steps of ``store`` found corrupt
        self._fork_bad: set[int] = set()  # the same, of the URI a fork resumes from
        self._resume_bad: set[int] = set()  # one of those two: the resume's source's
        # a fork's source (another URI, or the run this job resumed with no store of its
        # own): a recovery before the job's own first checkpoint restores it, not step 0
        self._origin: tuple[CheckpointStore, int] | None = None
        self._nonce: str | None = None  # this run's claim of ``store``
        # the name of the checkpoint that ended last (committed or not): a rank's late report
        # of it, or of an earlier one of its group, starts nothing
        self.ended: tuple[int | None, int | None] = (None, None)
        self.gen_now = -1  # the newest group formed: reports of earlier ones are void
        # (gen, seq, step) -> rank: held by a rank with nothing left to end it
        self._orphans: dict[tuple[Any, Any, int], int] = {}

    # ------------------------------------------------------------------ taking them

    def _ended_already(self, gen: int | None, seq: int | None) -> bool:
        """Whether checkpoint (gen, seq) has ended: the last one that ended, or an earlier
        one of its group (a group ends its checkpoints in the order it began them). A report
        without a name (none is sent without) is never taken for an ended one."""
        egen, eseq = self.ended
        if gen is None or seq is None or egen is None or eseq is None:
            return False
        return gen == egen and seq <= eseq

    def on_metric(self, m: dict[str, Any], spec: StrategySpec | None) -> None:
        """What a worker's step metrics say about checkpoints. A metric without a
        ``generation`` is of the current one."""
        gen = m.get("generation")
        if gen is not None and gen < self.gen_now:
            return  # of a group that a regroup replaced (drained after it)
        if m.get("peer_copies_off") and m["rank"] == 0:  # the same word on every rank
            self._emit("peer_copies_off", f"step {m['step']}: {m['peer_copies_off']}; a lost "
                       "node's sharded state comes from the last checkpoint")
        seq = m.get("checkpoint_seq")
        if "checkpoint_begun" in m and self._ended_already(gen, seq):
            # a rank's report of a checkpoint that has ended already (its metrics came after
            # the commit, or after a regroup gave it up): not a new checkpoint in flight,
            # which nothing would ever finish (the end of the run waited 300 s for it); its
            # blocked time goes to that one's event when it was committed
            ev = self.last_event
            if ev is not None and self._last_id == (gen, seq):
                ev.data["blocked_s"] = max(ev.data["blocked_s"],
                                           float(m.get("checkpoint_blocked_s") or 0.0))
        elif "checkpoint_begun" in m:
            ck = self.in_flight
            if ck is None or (ck["step"], ck["gen"], ck["seq"]) != (m["checkpoint_begun"], gen,
                                                                   seq):
                ck = self.in_flight = {"step": m["checkpoint_begun"], "gen": gen, "seq": seq,
                                       "blocked_s": 0.0, "spec": spec, "t0": time.time(),
                                       "by_rank": {}}
            ck["by_rank"][m["rank"]] = m["checkpoint_blocked_s"]
            ck["blocked_s"] = max(ck["by_rank"].values())
        if m.get("checkpoint_wait_s"):  # the next update waited for the host copy
            self._count_wait(m["rank"], float(m["checkpoint_wait_s"]))
        if m.get("checkpoint_skipped") and m["rank"] == 0:
            self._emit("checkpoint_skipped", f"step {m['checkpoint_skipped']}: the previous "
                       "checkpoint is still uploading")
        if "checkpoint_held" in m:
            self._check_held(m["rank"], int(m["checkpoint_held"]), m.get("checkpoint_held_gen"),
                             m.get("checkpoint_held_seq"))

    def _check_held(self, rank: int, step: int, gen: int | None, seq: int | None) -> None:
        """A rank skipped a due checkpoint because its writer still holds (gen, seq): fine
        while that one is in flight (a slow upload); otherwise nothing will ever end it
        (every later checkpoint would be skipped), so the next ``tick`` releases it."""
        ck = self.in_flight
        if ck is not None and (ck["step"], ck["gen"], ck["seq"]) == (step, gen, seq):
            return
        # (one that ended: its word did not act on this rank, or it has just ended: the
        # word again does no harm)
        self._orphans.setdefault((gen, seq, step), rank)

    def _count_wait(self, rank: int, wait_s: float) -> None:
        """A rank's wait for the deferred host copy counts as blocked time of its checkpoint:
        the one in flight, else (its commit came first) the last committed one's event."""
        ck = self.in_flight
        if ck is not None:
            by = ck["by_rank"]
            by[rank] = by.get(rank, 0.0) + wait_s
            ck["blocked_s"] = max(by.values())
        elif self.last_event is not None:
            d = self.last_event.data
            d["update_wait_s"] = max(d.get("update_wait_s", 0.0), wait_s)

    def tick(self, group: Any) -> None:
        """Commit the checkpoint in flight once every rank's shard is in; abandon it (and say
        so) if any upload failed. Training is never stopped by a checkpoint."""
        self._release_orphans(group)
        ck = self.in_flight
        if ck is None or self.store is None:
            return
        limit = float(self.cfg.checkpoint_upload_timeout_s)  # > 0 (validated)
        if time.time() - ck["t0"] > limit:  # a storage call that never returns
            self._give_up(group, f"given up: not uploaded and committed within "
                          f"checkpoint_upload_timeout_s={limit:g}s (a storage call that does "
                          "not return); the next one is taken as usual", timeout_s=limit)
            return
        outs = group.checkpoint_poll()
        errors = [o["error"] for o in outs if o and "error" in o]
        if not errors and not all(o and "info" in o for o in outs):
            return  # still uploading
        step, spec, name = ck["step"], ck["spec"], (ck["gen"], ck["seq"])
        self._end()
        manifest = None
        bad = {o["info"]["rank"]: o["info"].get("nonfinite") for o in outs
               if o and "info" in o and o["info"].get("nonfinite")}
        if bad and not errors:  # never a checkpoint of a state with NaN or inf in it
            group.checkpoint_done(step, False, *name)
            self._emit("checkpoint_refused", _nonfinite_note(step, bad), step=step,
                       data={"step": step, "nonfinite": {str(r): list(k)
                                                          for r, k in bad.items()}})
            return
        if not errors:
            infos = sorted((o["info"] for o in outs if o), key=lambda i: i["rank"])
            try:
                manifest = commit(self.store, step, infos, _meta(self.cfg, spec, step),
                                  nonce=self._nonce)
            except CheckpointOwnerError:
                group.checkpoint_done(step, False, *name)
                raise  # the job ends: another run of it writes here now
            except CheckpointError as e:
                errors.append(str(e))
        group.checkpoint_done(step, manifest is not None, *name)
        if manifest is not None:
            self.bad_steps.discard(step)  # written again, whole: a corrupt one it replaced
        if manifest is None:
            self._emit("checkpoint_failed", f"step {step} not committed, training goes on: "
                       f"{errors[0][:300]}", data={"step": step, "errors": errors}, step=step)
            return
        size = sum(sh.size for sh in manifest.shards)
        up = time.time() - ck["t0"]
        self._last_id = name
        self.last_event = self._emit(
            "checkpoint", f"step {step} committed: {megabytes(size)} MB in "
            f"{len(manifest.shards)} shards, training blocked {ck['blocked_s'] * 1e3:.0f} ms, "
            f"upload+commit {up:.2f}s", data={"step": step, "bytes": size,
                                              "blocked_s": ck["blocked_s"], "seconds": up,
                                              "uri": self.store.uri}, step=step)
        try:
            apply_retention(self.store, keep_last=self.cfg.keep_last,
                            keep_every=self.cfg.keep_every, bad=self.bad_steps)
        except CheckpointError as e:
            self._emit("retention_failed", str(e)[:300])

    def _end(self) -> dict[str, Any]:
        """The checkpoint in flight has ended (committed or not): returns it."""
        ck = self.in_flight
        assert ck is not None
        self.in_flight = None
        self.ended = (ck["gen"], ck["seq"])
        return ck

    def _give_up(self, group: Any, why: str, **data: Any) -> None:
        """End the checkpoint in flight uncommitted: the workers (``group``; None when it is
        gone) release it, and a ``checkpoint_failed`` event says ``why``."""
        ck = self._end()
        if group is not None:
            group.checkpoint_done(ck["step"], False, ck["gen"], ck["seq"])
        self._emit("checkpoint_failed", f"step {ck['step']} {why}",
                   data={"step": ck["step"], **data}, step=ck["step"])

    def _release_orphans(self, group: Any) -> None:
        for (gen, seq, step), rank in sorted(self._orphans.items(), key=lambda kv: kv[0][2]):
            group.checkpoint_done(step, False, gen, seq)
            if self._ended_already(gen, seq):
                continue  # it ended just as the rank gave up waiting: nothing to say
            self._emit("checkpoint_failed", f"step {step} released: rank {rank} still held it "
                       "with nothing left to commit it; the next one is taken as usual",
                       data={"step": step, "released": True})
        self._orphans.clear()

    def abandon(self, group: Any) -> None:
        """At a regroup: the checkpoint in flight cannot complete without the group that
        began it; a later report of it starts nothing (its name has ended). One the controller
        had not seen (drained after this) is in flight until ``formed`` gives it up. The
        workers release theirs when they join the next group."""
        self._orphans.clear()
        if self.in_flight is not None:
            self._give_up(group, "abandoned: the group that was uploading it changed (a "
                          "worker lost, or the job resized or evacuated)")

    def formed(self, generation: int) -> None:
        """Group ``generation`` is up: reports of earlier groups are void from now on, and
        one of theirs still in flight (reported after the regroup gave the last one up) can
        never be committed: its workers released it when they joined this group."""
        self.gen_now = max(self.gen_now, generation)
        ck = self.in_flight
        if ck is not None and ck["gen"] is not None and ck["gen"] < generation:
            self._give_up(None, "abandoned: the group that was uploading it changed")

    def settle(self, group: Any, timeout_s: float) -> dict[str, Any] | None:
        """Before a planned regroup (a resize): give the checkpoint in flight up to
        ``timeout_s`` to commit (the workers keep uploading meanwhile), then abandon it.
        Returns what it waited for ({step, seconds, committed}), None if nothing was in
        flight."""
        ck, ev, t0 = self.in_flight, self.last_event, time.monotonic()
        self._wait_in_flight(group, timeout_s)
        committed = ck is not None and self.last_event is not ev
        # the resize may still give up (no spare came up) and the group go on: its next
        # checkpoints are new names; ``formed`` voids its reports once the next group is up
        self.abandon(group)
        if ck is None:
            return None
        return {"step": ck["step"], "seconds": time.monotonic() - t0, "committed": committed}

    def final(self, group: Any, spec: StrategySpec, step: int) -> None:
        """A job stopped before ``max_steps`` (a request, a signal): take a checkpoint of
        the state it stopped at, unless one of that step is committed or in flight already."""
        if self.store is None or self.in_flight is not None and self.in_flight["step"] == step:
            return
        last = self.last_event.data.get("step") if self.last_event is not None else None
        if last == step:
            return
        # the one in flight first: the workers wait for its commit before they begin this
        # one, and nothing would commit it while they wait in this call
        self.finish(group, float(self.cfg.checkpoint_wait_s), "the stop")
        for out in group.checkpoint_now():
            self.on_metric(out, spec)

    def finish(self, group: Any, timeout_s: float = 300.0, when: str = "the end of the run"
               ) -> None:
        """Wait (bounded) for the checkpoint in flight to commit: at the end of the run,
        before a stop's final checkpoint, before a rollback chooses where to go back to. One
        that does not is given up, on the workers too."""
        self._release_orphans(group)
        self._wait_in_flight(group, timeout_s)
        if self.in_flight is not None:
            self._give_up(group, f"did not finish uploading within {timeout_s:.0f}s of {when}")

    def _wait_in_flight(self, group: Any, timeout_s: float) -> None:
        """Tick until the checkpoint in flight has ended, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight is not None and time.monotonic() < deadline:
            self.tick(group)
            if self.in_flight is not None:
                time.sleep(0.05)

    # ------------------------------------------------------------------ restoring

    def claim(self, planned: tuple[CheckpointStore, int] | None = None) -> None:
        """Claim the job's checkpoint URI before anything is written there (the fix when
        another job holds it), then check what the start ``planned`` again (``check_claimed``)."""
        from ..checkpoint import claim

        if self.store is None:
            return
        got = claim(self.store, self.cfg.job_name)
        check_claimed(self.store, planned, self.bad_steps, self.cfg.job_name)
        self._nonce = got.record.nonce  # this run's: its commits are refused once another
        if got.fresh:  # run of the job takes the URI over (an earlier run still going stops)
            self._emit("claimed", f"checkpoint URI {self.store.uri} claimed for job "
                       f"{self.cfg.job_name}" + ("" if got.atomic else
                                                 " (this storage has no atomic create)"),
                       data={"uri": self.store.uri, "atomic": got.atomic})

    def find_resume(self, resume: str, model: Any = None) -> tuple[CheckpointStore, int]:
        """The checkpoint ``resume`` names (``latest``, a root, or one step's directory),
        checked: the newest intact one (a newer one passed over is an event), the job's own
        or an explicit fork, before ``max_steps``, holding ``model``'s entries (if given)."""
        from ..checkpoint import plan_resume
        from ..checkpoint_io import job_store

        plan = plan_resume(resume, self.cfg.job_name, own=self.store or job_store(self.cfg),
                           options=self.cfg.checkpoint_options, exclude=self._resume_bad,
                           max_steps=self.cfg.max_steps)
        bad = self._resume_bad = self._bad_of(plan.store)  # (a fallback plans again: same)
        for c in plan.skipped:
            bad.add(c.step)
            self._emit("checkpoint_skipped", c.note, data={"step": c.step,
                                                           "object": c.bad_object})
        if plan.fork:
            if self.store is not None:  # its steps go to its own URI: nothing may be there
                refuse_newer(self.store, -1, "checkpoint_uri", self.bad_steps)
            self._emit("forked", f"resuming from another URI, {plan.store.uri} step {plan.step}"
                       + (f" (written by job {plan.source_owner})" if plan.source_owner else "")
                       + "; this job writes to its own", data={"uri": plan.store.uri,
                                                              "step": plan.step})
        elif self.store is not None:  # (a job that writes no checkpoint overwrites none)
            refuse_newer(plan.store, plan.step, "resume", self.bad_steps)
        why = sampling_changed(plan.manifest, self.cfg)
        if why and not plan.fork:
            raise ConfigError(why[0], why[1], why[2])
        if why:  # a fork starts a run of its own: said, not refused (a warm start)
            self._emit("resume_sampling", f"{why[0]}: {why[1]}", data={"field": why[0]})
        if model is not None:
            model_unlike(plan.store, plan.manifest, model)
        return plan.store, plan.step

    def auto_resume(self) -> bool:
        """``resume: auto``: whether the job's own URI holds a committed checkpoint to go on
        from (else the job starts fresh, as a first attempt of a requeued driver does)."""
        return self.store is not None and bool(committed_steps(self.store))

    def check_fresh(self) -> None:
        """A run that starts fresh (no ``resume``, ``auto`` with nothing to go on from; a
        fork: ``find_resume``) starts where no checkpoint is committed: its steps would be written over the ones there, and retention, a
        recovery and a later ``resume: latest`` would mix the two runs (``ConfigError``
        naming the fix)."""
        from ..checkpoint import read_owner

        if self.store is None:
            return
        owner = read_owner(self.store)
        if owner is None or owner.job == self.cfg.job_name:  # another's: ``claim`` says so
            refuse_newer(self.store, -1, "checkpoint_uri", self.bad_steps)

    def _bad_of(self, store: CheckpointStore) -> set[int]:
        """The steps found corrupt of ``store``: the job's own, or a fork's source."""
        own = self.store is None or store.same_place(self.store)
        return self.bad_steps if own else self._fork_bad

    def resume(self, group: Any, spec: StrategySpec, store: CheckpointStore, step: int) -> int:
        """Restore the checkpoint a resume planned; when the workers find it corrupt (bytes
        that do not match the manifest) and ``resume`` names no step, fall back to the next
        older intact one, an event naming each bad one. Returns the step restored."""
        from ..checkpoint import resume_store
        from ..errors import CheckpointCorruptError

        pinned = resume_store(self.cfg.resume, store)[1] is not None
        while True:
            try:
                self.restore(group, spec, store, step, reason="resume")
                own = self.store is not None and store.same_place(self.store)
                self._origin = None if own else (store, step)
                return step
            except CheckpointCorruptError as e:
                if pinned:
                    raise
                self._bad_of(store).add(step)
                self._emit("checkpoint_corrupt", f"checkpoint step {step} at {store.uri} cannot "
                           f"be restored: {str(e)[:300]}; resuming from an older one",
                           data={"step": step, "shard": getattr(e, "shard", None)})
                store, step = self.find_resume(self.cfg.resume)

    def restore(self, group: Any, spec: StrategySpec, store: CheckpointStore, step: int,
                reason: str) -> None:
        """Lay ``spec`` out from checkpoint ``step`` of ``store`` on every worker."""
        t0 = time.time()
        outs = group.restore_checkpoint(spec, step, store)
        self._emit("resumed" if reason == "resume" else "restored",
                   f"from checkpoint step {step} at {store.uri} in {time.time() - t0:.2f}s"
                   f"{read_detail(outs)}",
                   data={"step": step, "uri": store.uri,
                         "bytes_read": [o["bytes"] for o in outs],
                         "state_bytes": outs[0]["total_bytes"] if outs else 0},
                   step=step if reason == "resume" else None)  # (a resume: the job's step)

    def valid_steps(self) -> tuple[int, ...]:
        """Committed steps a restore may use, newest first (found-corrupt ones excluded).
        ``StorageError`` when the storage cannot list them: an outage is not "no
        checkpoint", which would restart from scratch while the newest is intact."""
        steps = committed_steps(self.store) if self.store is not None else []
        out = tuple(s for s in reversed(steps) if s not in self.bad_steps)
        o = self._origin  # (the job's own steps all come after it: its URI was empty)
        fork = o is not None and o[1] not in self._fork_bad and (not out or o[1] < out[-1])
        return out + ((o[1],) if fork and o is not None else ())

    def restore_newest(self, group: Any, spec: StrategySpec, steps: tuple[int, ...]
                       ) -> tuple[int, str] | None:
        """Restore the newest of ``steps`` (newest first) that loads. One that does not (a
        corrupt or missing object) is remembered as bad, said in a ``checkpoint_corrupt``
        event naming it, and the next older one is tried. Returns (step, detail), or None if
        none loaded. A ``StorageError`` (the storage failed, not the checkpoint) is raised:
        an outage must not pass the newest intact step over for an older one or scratch."""
        for step in steps:
            if step in self.bad_steps:
                continue
            source = origin_of(self._origin, step)
            try:
                outs = group.restore_checkpoint(spec, step, source)
            except StorageError:
                raise
            except CheckpointError as e:
                (self._fork_bad if source is not None else self.bad_steps).add(step)
                at = source or self.store
                uri = at.uri if at is not None else "?"
                self._emit("checkpoint_corrupt", f"checkpoint step {step} at {uri} cannot be "
                           f"restored: {str(e)[:300]}; trying an older one",
                           data={"step": step, "error": str(e)[:500]})
                continue
            took = max(o["seconds"] for o in outs)
            fork = f" of {source.uri} (the run this job was forked from)" if source else ""
            return step, (f", checkpoint step {step}{fork} read in {took:.2f}s"
                          f"{read_detail(outs)}")
        return None


def _nonfinite_note(step: int, bad: dict[int, Any]) -> str:
    """What a refused checkpoint's event says: the ranks and entries holding NaN or inf."""
    where = "; ".join(f"rank {r}: {', '.join(list(k)[:3])}" for r, k in sorted(bad.items()))
    return (f"step {step} not committed: its state holds non-finite values ({where}); the "
            "newest committed checkpoint stays the last good one")


def _meta(cfg: Any, spec: StrategySpec, step: int) -> CheckpointMeta:
    """What a committed checkpoint says of the job that wrote it."""
    return CheckpointMeta(
        plan=spec_dict(spec), world_size=spec.world_size, data_position=step,
        rng={"seed": cfg.seed}, strategy=spec.name, owner=cfg.job_name,
        extra={"job": cfg.job_name, "global_batch_size": cfg.global_batch_size,
               "dataset_length": cfg.dataset_length})


def unsaved(events: Sequence[Any]) -> str | None:
    """What of a finished run no checkpoint holds: where a checkpoint failed after the
    newest committed one (its storage gone at the end of the run), which; else None."""
    held = [e for e in events if e.kind in ("checkpoint", "resumed")]  # (a resume's step
    # is committed too: found by review, session 47)
    last = max(held, key=lambda e: e.data.get("step", 0), default=None)
    newest = last.data.get("step", 0) if last is not None else 0
    failed = [e.data.get("step", 0) for e in events if e.kind == "checkpoint_failed"
              and not e.data.get("released") and e.data.get("step", 0) > newest]
    if not failed:
        return None
    where = f" at {last.data['uri']}" if last is not None and last.data.get("uri") else ""
    kept = f"step {newest}{where}" if newest else "none"
    return (f"the checkpoint of step {max(failed)} was not committed: the newest committed "
            f"checkpoint is {kept}")


def last_checkpoint(tracker: CheckpointTracker, group: Any, stopped: StrategySpec | None,
                    step: int, emit: Emit) -> None:
    """At the end of a run whose final state is taken: wait for the checkpoint in flight (the
    last step's), and for a job ``stopped`` early take one of the state it stopped at. A
    worker lost meanwhile costs that checkpoint (``checkpoint_failed``), not the run. Was:
    the state was taken after this wait, so a node lost in it sent a run that had completed
    every step into a recovery, or failed it below min_workers (found by review, session 44)."""
    try:
        if stopped is not None:
            tracker.final(group, stopped, step)
        tracker.finish(group)
    except InfrastructureError as e:
        tracker.in_flight = None  # (nothing can commit it now)
        emit("checkpoint_failed", f"the last checkpoint (step {step}) was not committed: "
             f"{str(e).splitlines()[0][:300]}; the run's final state is kept",
             data={"step": step}, step=step)


def origin_of(origin: tuple[CheckpointStore, int] | None, step: int) -> CheckpointStore | None:
    """The store ``step`` is restored from: a fork's source (``origin``) for its step (the
    job's own steps all come after it: ``valid_steps``), else the job's own (None)."""
    return origin[0] if origin is not None and step == origin[1] else None
