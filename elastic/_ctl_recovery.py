"""The controller's recovery from lost workers: the hang watchdog, survivors, the
roll-forward of a straddled step, replacements, and the state restored from surviving
replicas or the last committed checkpoint (docs/architecture.md, Node loss)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from strategies import StrategySpec

from ._ctl_base import (
    ControllerBase,
    ControllerState,
    WorkerRec,
)
from .errors import InfrastructureError

__all__ = ["RecoveryMixin"]


class RecoveryMixin(ControllerBase):
    """Surviving the loss of workers."""

    def _roll_forward(self) -> None:
        """A step's final all-reduce can complete on some ranks and fail on others, so
        survivors may straddle two steps. If any survivor applied step s, every rank had
        complete gradients for it (each entered that all-reduce only then): the survivors
        still at s that can apply theirs without communication do so, and every entry has a
        live holder at s + 1 again."""
        import ray

        try:
            progress = ray.get([w.handle.progress.remote() for w in self.workers], timeout=30)
        except Exception:  # a survivor that cannot answer: failure handling sees it later
            return
        top = max((p["next_step"] for p in progress), default=0)
        behind = [w for w, p in zip(self.workers, progress, strict=True)
                  if p["next_step"] == top - 1 and p.get("pending_update")]
        if behind:
            ray.get([w.handle.finish_pending_step.remote() for w in behind])
            self._emit("rolled_forward", f"rank(s) {[w.rank for w in behind]} applied step "
                       f"{top - 1}'s update, which peers had applied when the node was lost",
                       data={"ranks": [w.rank for w in behind], "step": top - 1})

    def _recover(self, error: BaseException) -> None:
        """Survive the loss of workers: keep the survivors' processes and memory, re-plan for
        the workers there are (taking replacements if they come within a bounded wait),
        restore state from surviving replicas if every entry still has a live copy, else from
        the last committed checkpoint, and go on from the restored step."""
        import ray

        t_fail = time.time()
        self.failures += 1
        self.state = ControllerState.RECOVERING
        before = self.history[-1]["step"] + 1 if self.history else self.step
        hung = self._hung_workers()
        survivors, dead = self._survivors(exclude=hung)
        t_detect = time.time()
        lost_nodes = sorted({str(w.info.get("node_id", ""))[:8] for w in dead})
        self._emit("failure", f"{len(dead)} worker(s) lost (ranks {[w.rank for w in dead]}, "
                   f"node(s) {lost_nodes}); {len(survivors)} survive: {str(error).splitlines()[0][:200]}",
                      data={"dead_ranks": [w.rank for w in dead], "nodes": lost_nodes,
                         "detect_s": t_detect - t_fail,
                         "survivor_pids": [w.info.get("pid") for w in survivors]})
        budget = self.cfg.max_failures
        if budget >= 0 and self.failures > budget:
            raise InfrastructureError(
                f"giving up after {self.failures} failures (max_failures={budget}): {error}. "
                "Fix: raise max_failures (-1 for unlimited) or fix the cluster."
            )
        for w in dead:
            try:
                ray.kill(w.handle)
            except Exception:
                pass
            self._free_slots.append((w.pg, w.slot))
        self.workers = survivors
        if self._ckpt is not None:  # a checkpoint in flight cannot complete without the dead
            for w in self.workers:
                w.handle.checkpoint_done.remote(self._ckpt["step"], False)
            self._emit("checkpoint_failed", f"step {self._ckpt['step']} abandoned: a worker "
                       "was lost during its upload")
            self._ckpt = None
        self._roll_forward()
        ray.get([w.handle.leave.remote() for w in self.workers])
        progress = ray.get([w.handle.progress.remote() for w in self.workers])
        held = ray.get([w.handle.held_keys.remote() for w in self.workers])
        old_spec, old_gen = self.spec, self.generation
        self._drain()
        # take replacements within a bounded wait; below min_workers wait longer, then fail
        want = max(self.cfg.num_workers, len(self.workers))
        want = min(want, self.cfg.max_world)
        self._take_warm(want - len(self.workers))
        if len(self.workers) < want:
            self._try_place(want - len(self.workers), self.cfg.replacement_timeout_s)
        if len(self.workers) < self.cfg.min_world:
            self._emit("waiting", f"{len(self.workers)} workers < min_workers="
                       f"{self.cfg.min_world}; waiting up to {self.cfg.min_workers_timeout_s:.0f}s")
            self._try_place(self.cfg.min_world - len(self.workers), self.cfg.min_workers_timeout_s)
            if len(self.workers) < self.cfg.min_world:
                raise InfrastructureError(
                    f"only {len(self.workers)} workers are left, fewer than min_workers="
                    f"{self.cfg.min_world}, and no replacement came within "
                    f"{self.cfg.min_workers_timeout_s:.0f}s. Fix: add nodes or lower min_workers."
                )
        self._form_group()
        spec = self._fit_spec(self._target_strategy(), len(self.workers))
        source, step, detail = self._restore(spec, progress, held)
        self.step = step
        # metrics of steps after the restored position are void (they will run again) ...
        self.history = [h for h in self.history if h["step"] < step]
        # ... and steps the restored state contains but nobody could report are recorded now
        done = self.history[-1]["step"] + 1 if self.history else 0
        for st in range(done, step):
            self._record_step(st, None, spec=old_spec, generation=old_gen)
        self.spec = spec
        took = time.time() - t_fail
        lost = max(0, before - step)
        pids = [w.info.get("pid") for w in self.workers]
        self._emit("recovered", f"from {source} in {took:.2f}s at step {step} on "
                   f"{len(self.workers)} workers ({spec.name}); {lost} step(s) lost{detail}",
                   data={"source": source, "seconds": took, "steps_lost": lost,
                         "detect_s": t_detect - t_fail, "world_size": len(self.workers),
                         "strategy": spec.name, "pids": pids})
        if self._room_to_grow():  # replacements start now, in the background
            self._warm_up()

    def _hung_workers(self) -> list[WorkerRec]:
        """The hang watchdog. After a failure every live rank's segment ends within the group
        timeout (its collectives fail); a rank still inside its segment after that is hung
        (stuck in a collective or in code that never returns) and is treated as lost."""
        import ray

        running, self._running = self._running, []
        deadline = time.monotonic() + self.cfg.hang_timeout_s + 5.0
        pending = list(running)
        while pending:
            finished, _ = ray.wait([f for _, f in pending], num_returns=len(pending), timeout=0)
            done = set(finished)
            for w, f in pending:  # a rank out of its segment closes its group at once, so
                if f in done:     # that peers blocked on it fail now, not at the group timeout
                    w.handle.leave.remote()
            pending = [(w, f) for w, f in pending if f not in done]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            ray.wait([f for _, f in pending], num_returns=1, timeout=left)
        hung = [w for w, _ in pending]
        if hung:
            self._emit("hang", f"rank(s) {[w.rank for w in hung]} did not leave their step "
                       f"within the group timeout ({self.cfg.hang_timeout_s:.0f}s): treated "
                       "as lost", data={"ranks": [w.rank for w in hung]})
        return hung

    def _survivors(self, exclude: Sequence[WorkerRec] = ()) -> tuple[list[WorkerRec],
                                                                      list[WorkerRec]]:
        """Ping every worker (its second thread answers even while the first is busy)."""
        import ray

        refs = [(w, w.handle.progress.remote()) for w in self.workers if w not in exclude]
        alive, dead = [], list(exclude)
        for w, ref in refs:
            try:
                ray.get(ref, timeout=10)
                alive.append(w)
            except Exception:
                dead.append(w)
        return alive, dead

    def _target_strategy(self) -> str:
        if self.cfg.strategy == "auto":
            return "auto"  # re-plan for the new membership
        return self.spec.name if self.spec else self.cfg.strategy

    def _restore(self, spec: StrategySpec, progress: list[dict[str, Any]],
                 held: list[dict[str, Any]]) -> tuple[str, int, str]:
        """Restore the state into the new group; returns (source, step, detail)."""
        import ray

        n_old = len(progress)
        steps = [p["next_step"] for p in progress if p["has_state"]]
        step = max(steps) if steps else 0
        required = self._required_keys(held)
        plan: list[tuple[str, int, tuple[int, ...], str]] = []
        if required:
            for key in sorted(required):
                src = next((r for r in range(n_old)
                            if key in held[r] and progress[r]["next_step"] == step), None)
                if src is None:
                    plan = []
                    break
                shape, dtype = held[src][key]
                plan.append((key, src, tuple(shape), dtype))
        if plan:
            outs = ray.get([w.handle.restore_from_peers.remote(spec, plan, step)
                            for w in self.workers])
            mb = outs[0]["bytes"] / 1e6
            return "peers", step, f", {mb:.1f} MB from surviving replicas"
        ck = self._checkpoint_restore(spec)
        if ck is not None:
            return ck
        ray.get([w.handle.restart_fresh.remote(spec, None, 0) for w in self.workers])
        return "scratch", 0, " (no live replica of every entry and no checkpoint: restarted)"

    def _required_keys(self, held: list[dict[str, Any]]) -> set[str]:
        """Every canonical key the state must have: the model's, plus each optimizer entry
        name seen on a survivor for every parameter (optimizers keep the same entries for
        all parameters once they have stepped)."""
        model_keys = {f"model/{k}" for k in self._probe_model.state_dict()}
        entry_names = {k.rpartition("/")[2] for h in held for k in h if k.startswith("optim/")}
        params = [n for n, _ in self._probe_model.named_parameters()]
        return model_keys | {f"optim/{p}/{e}" for p in params for e in entry_names}
