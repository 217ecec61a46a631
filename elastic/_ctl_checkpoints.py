"""The controller's checkpoints: commit the manifest once every rank's shard is in, apply
retention, find the checkpoint to resume from, and restore a layout from one."""

from __future__ import annotations

import time
from typing import Any

from strategies import StrategySpec

from ._ctl_base import (
    ControllerBase,
    read_detail,
    spec_dict,
    unwrap,
)

__all__ = ["CheckpointMixin"]


class CheckpointMixin(ControllerBase):
    """Committing, finding and restoring checkpoints."""

    def _checkpoint_tick(self) -> None:
        """Commit the checkpoint in flight once every rank's shard is in; abandon it (and
        say so) if any upload failed. Training is never stopped by a checkpoint."""
        import ray

        ck = self._ckpt
        if ck is None:
            return
        from .checkpoint import CheckpointMeta, apply_retention, commit
        from .errors import CheckpointError

        outs = []
        for w in self.workers:
            try:
                outs.append(ray.get(w.handle.checkpoint_poll.remote(), timeout=30))
            except Exception:
                outs.append({"error": f"worker {w.rank} did not answer"})
        errors = [o["error"] for o in outs if o and "error" in o]
        if not errors and not all(o and "info" in o for o in outs):
            return  # still uploading
        step, spec = ck["step"], ck["spec"]
        self._ckpt = None
        manifest = None
        if not errors:
            infos = sorted((o["info"] for o in outs if o), key=lambda i: i["rank"])
            meta = CheckpointMeta(
                plan=spec_dict(spec), world_size=spec.world_size, data_position=step,
                rng={"seed": self.cfg.seed}, strategy=spec.name,
                extra={"job": self.cfg.job_name, "global_batch_size": self.cfg.global_batch_size})
            try:
                manifest = commit(self._store, step, infos, meta)
            except CheckpointError as e:
                errors.append(str(e))
        for w in self.workers:
            w.handle.checkpoint_done.remote(step, manifest is not None)
        if manifest is None:
            self._emit("checkpoint_failed", f"step {step} not committed, training goes on: "
                       f"{errors[0][:300]}", data={"step": step, "errors": errors}, step=step)
            return
        size = sum(sh.size for sh in manifest.shards)
        up = time.time() - ck["t0"]
        self._emit("checkpoint", f"step {step} committed: {size / 1e6:.1f} MB in "
                   f"{len(manifest.shards)} shards, training blocked {ck['blocked_s'] * 1e3:.0f} ms, "
                   f"upload+commit {up:.2f}s", data={"step": step, "bytes": size,
                                                     "blocked_s": ck["blocked_s"], "seconds": up,
                                                     "uri": self._store.uri}, step=step)
        try:
            apply_retention(self._store, keep_last=max(1, self.cfg.keep_last),
                            keep_every=self.cfg.keep_every)
        except CheckpointError as e:
            self._emit("retention_failed", str(e)[:300])

    def _finish_checkpoint(self, timeout_s: float = 300.0) -> None:
        """At the end of the run, wait (bounded) for the checkpoint in flight to commit."""
        deadline = time.monotonic() + timeout_s
        while self._ckpt is not None and time.monotonic() < deadline:
            self._checkpoint_tick()
            if self._ckpt is not None:
                time.sleep(0.1)
        if self._ckpt is not None:
            self._emit("checkpoint_failed", f"step {self._ckpt['step']} did not finish uploading "
                       f"within {timeout_s:.0f}s of the end of the run")
            self._ckpt = None

    def _find_resume(self, resume: str) -> tuple[Any, int]:
        """``latest``: the job's newest valid checkpoint; a URI: a checkpoint root (its newest
        valid one) or one step directory (``.../step-000000000100``)."""
        import re

        from .checkpoint import CheckpointStore, find_latest_valid
        from .errors import CheckpointError

        if resume == "latest":
            from .checkpoint_io import job_store

            store = self._store or job_store(self.cfg)
            step = None
        else:
            m = re.match(r"^(.*?)/?step-(\d+)/?$", resume)
            root = m.group(1) if m else resume
            store = CheckpointStore(root, dict(self.cfg.checkpoint_options))
            step = int(m.group(2)) if m else None
        manifest, notes = find_latest_valid(store, exclude=())
        if step is not None:
            from .checkpoint import read_manifest

            manifest = read_manifest(store, step)
        if manifest is None:
            raise CheckpointError(
                f"resume={store.redact(resume)!r}: no committed checkpoint under {store.uri}"
                + (f" ({'; '.join(notes)})" if notes else "")
                + ". Fix: check the URI, or drop resume to start fresh.")
        for n in notes:
            self._emit("checkpoint_skipped", n)
        return store, manifest.step

    def _restore_from(self, store: Any, step: int, reason: str) -> None:
        import ray

        assert self.spec is not None
        t0 = time.time()
        try:
            outs = ray.get([w.handle.restore_checkpoint.remote(self.spec, step, store)
                            for w in self.workers])
        except Exception as e:
            raise unwrap(e) from None
        self.step = step
        self._emit("resumed" if reason == "resume" else "restored",
                   f"from checkpoint step {step} at {store.uri} in {time.time() - t0:.2f}s"
                   f"{read_detail(outs)}",
                   data={"step": step, "uri": store.uri,
                         "bytes_read": [o["bytes"] for o in outs],
                         "state_bytes": outs[0]["total_bytes"] if outs else 0})

    def _checkpoint_wait(self, rank: int, wait_s: float) -> None:
        """Count a rank's wait for the deferred host copy as blocked time of its checkpoint:
        the one in flight, else (its commit came first) the last committed one's event."""
        ck = self._ckpt
        if ck is not None:
            by = ck.setdefault("by_rank", {})
            by[rank] = by.get(rank, 0.0) + wait_s
            ck["blocked_s"] = max(by.values())
            return
        ev = next((e for e in reversed(self.events) if e.kind == "checkpoint"), None)
        if ev is not None:
            ev.data["update_wait_s"] = max(ev.data.get("update_wait_s", 0.0), wait_s)

    def _checkpoint_restore(self, spec: StrategySpec) -> tuple[str, int, str] | None:
        """Fall back to the newest valid committed checkpoint (None if there is none)."""
        import ray

        if self._store is None:
            return None
        from .checkpoint import find_latest_valid

        manifest, notes = find_latest_valid(self._store)
        for n in notes:
            self._emit("checkpoint_skipped", n)
        if manifest is None:
            return None
        outs = ray.get([w.handle.restore_checkpoint.remote(spec, manifest.step)
                        for w in self.workers])
        took = max(o["seconds"] for o in outs)
        return ("checkpoint", manifest.step,
                f", checkpoint step {manifest.step} read in {took:.2f}s{read_detail(outs)}")
