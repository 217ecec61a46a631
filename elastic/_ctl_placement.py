"""The controller's placement and scaling: connect to Ray, reserve bundles, start workers
(in the foreground, or in the background as warm spares), form each generation of the group,
and grow or shrink the job at a step boundary."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ._ctl_base import (
    ControllerBase,
    ControllerState,
    WorkerRec,
    check_reachable,
    pg_ready,
    unwrap,
)
from .errors import ClusterError

__all__ = ["PlacementMixin"]


class PlacementMixin(ControllerBase):
    """Placing workers, forming groups, growing and shrinking."""

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        addr = self.cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if addr and addr not in ("local", "auto"):
            check_reachable(addr)
            try:
                ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False)
            except Exception as e:
                raise ClusterError(
                    f"cannot connect to the Ray cluster at {addr}: {e}. Fix: check the address "
                    "or start a cluster with `ray start --head`, or unset RAY_ADDRESS for a "
                    "local one."
                ) from e
        elif addr == "auto":
            ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
        else:
            need = self.cfg.max_world * float(self.cfg.resources_per_worker.get("CPU", 1))
            ray.init(address="local", num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
                     include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
            self._started_ray = True

    def _bundle(self) -> dict[str, float]:
        import ray

        res = dict(self.cfg.resources_per_worker)
        if self.cfg.use_gpu is None:
            self._use_gpu = res.get("GPU", 0) > 0 or ray.cluster_resources().get("GPU", 0) > 0
        else:
            self._use_gpu = bool(self.cfg.use_gpu)
        if self._use_gpu:
            res["GPU"] = max(1.0, res.get("GPU", 1.0))
        else:
            res.pop("GPU", None)
        res.setdefault("CPU", 1)
        return res

    def _place(self, n: int) -> list[WorkerRec]:
        """Reserve ``n`` bundles in one placement group and start one worker in each."""
        import ray
        from ray.util.placement_group import placement_group

        self.state = ControllerState.PLACING
        bundle = self._bundle()
        pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=self.cfg.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise ClusterError(
                f"the cluster cannot host {n} workers of {bundle} within "
                f"{self.cfg.placement_timeout_s:.0f}s (it has {ray.available_resources()}). "
                "Fix: lower num_workers or resources_per_worker, or add nodes."
            )
        new = self._start_workers(pg, list(range(n)), bundle)
        if len(new) < self.cfg.min_world:
            raise ClusterError(
                f"only {len(new)} of {n} workers started (min_workers={self.cfg.min_world}); "
                f"a worker failed to start: {self._start_error}. Fix: check that the job's "
                "code imports and its factories run on the cluster's nodes.")
        infos = [w.info for w in new]
        nodes = len({i["node_id"] for i in infos})
        self._emit("placed", f"{n} workers on {nodes} node(s), devices "
                   f"{sorted({i['device_name'] for i in infos})}")
        return new

    def _start_workers(self, pg: Any, slots: list[int], bundle: dict[str, float],
                       wait_s: float | None = None) -> list[WorkerRec]:
        """Start one worker in each bundle ``slots`` of ``pg``. With ``wait_s``, workers that
        are not up by then are given up (their slot stays free) instead of waited for."""
        return self._collect(self._launch(pg, slots, bundle), wait_s)

    def _launch(self, pg: Any, slots: list[int], bundle: dict[str, float]
                ) -> list[tuple[WorkerRec, Any]]:
        """Create the worker actors (non-blocking); returns (worker, ref of its info)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import Worker

        remote_cls: Any = ray.remote(Worker)
        new = []
        for i in slots:
            wid = self._next_worker_id
            self._next_worker_id += 1
            h = remote_cls.options(
                num_cpus=bundle.get("CPU", 1),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                max_concurrency=2,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i),
            ).remote(self.cfg, wid, self._use_gpu, int(bundle.get("CPU", 1)))
            rec = WorkerRec(h, wid, pg=pg, slot=i)
            new.append((rec, h.info.remote()))
        return new

    def _collect(self, launched: list[tuple[WorkerRec, Any]], wait_s: float | None
                 ) -> list[WorkerRec]:
        """Take launched workers that are up (within ``wait_s``; None: wait for all) into
        the job; the others are killed and their slots freed."""
        import ray

        refs = [ref for _, ref in launched]
        if wait_s is not None and refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        up = []
        for w, ref in launched:
            try:
                w.info = ray.get(ref, timeout=0 if wait_s is not None else None)
                up.append(w)
            except Exception as e:
                lines = str(unwrap(e)).strip().splitlines()
                self._start_error = lines[-1][:500] if lines else type(e).__name__
                try:
                    ray.kill(w.handle)
                except Exception:
                    pass
                self._free_slots.append((w.pg, w.slot))
        if self.cfg.emulate:
            emus = self.cfg.emulate
            infos = ray.get([w.handle.set_emulation.remote(emus[w.worker_id % len(emus)])
                             for w in up])
            for w, info in zip(up, infos, strict=True):
                w.info = info
        self.workers.extend(up)
        return up

    def _warm_up(self) -> None:
        """Room appeared (a free reserved slot became placeable, or free resources for one
        more worker): start workers there in the background, up to the target size. Their
        start-up (process, imports, the job's factories) overlaps training."""
        import ray
        from ray.util.placement_group import placement_group

        need = self._target_world - len(self.workers) - len(self._warming)
        if need <= 0:
            return
        bundle = self._bundle()
        ready_slots = [(pg, i) for pg, i in self._free_slots if pg_ready(pg)][:need]
        for pg, i in ready_slots:
            self._free_slots.remove((pg, i))
            self._warming += self._launch(pg, [i], bundle)
        need -= len(ready_slots)
        if need > 0 and not ready_slots:
            free = ray.available_resources()
            if all(free.get(k, 0.0) >= v for k, v in bundle.items() if v > 0):
                pg = placement_group([dict(bundle)])
                ok, _ = ray.wait([pg.ready()], timeout=1.0)
                if ok:
                    self._warming += self._launch(pg, [0], bundle)
                else:
                    ray.util.remove_placement_group(pg)

    def _warm_ready(self) -> bool:
        """Whether a warm spare is up (its info answered)."""
        import ray

        if not self._warming:
            return False
        done, _ = ray.wait([ref for _, ref in self._warming], timeout=0)
        return bool(done)

    def _take_warm(self, n: int) -> list[WorkerRec]:
        """Take up to ``n`` warm spares that are up into the job (spares that failed to
        start are dropped, their slots freed); the rest keep warming."""
        import ray

        if n <= 0 or not self._warming:
            return []
        refs = [ref for _, ref in self._warming]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_ids = {id(r) for r in done}
        finished = [(w, r) for w, r in self._warming if id(r) in done_ids][:n]
        taken_ids = {id(w) for w, _ in finished}
        self._warming = [(w, r) for w, r in self._warming if id(w) not in taken_ids]
        up = self._collect(finished, wait_s=0)
        if up:
            self._emit("joined", f"{len(up)} warm worker(s) taken in on node(s) "
                       f"{sorted({str(w.info.get('node_id'))[:8] for w in up})}")
        return up

    def _form_group(self) -> None:
        import ray

        self.state = ControllerState.FORMING
        self.generation += 1
        for r, w in enumerate(self.workers):
            w.rank = r
            w.info["rank"] = r
        head = self.workers[0]
        port = ray.get(head.handle.free_port.remote())
        addr = head.info["ip"]
        t0 = time.perf_counter()
        ray.get([
            w.handle.join.remote(addr, port, w.rank, len(self.workers), self.generation,
                                 self.cfg.hang_timeout_s)
            for w in self.workers
        ])
        self._emit("group", f"generation {self.generation}: {len(self.workers)} ranks via "
                   f"{addr}:{port} in {time.perf_counter() - t0:.2f}s")
        self.view.workers([w.info for w in self.workers])

    def _try_place(self, n: int, timeout_s: float) -> None:
        """Place up to ``n`` more workers within ``timeout_s``; keep what could be placed.

        First the job's own free slots: a bundle whose node died is re-reserved by Ray on
        another node when one has room, so a replacement node lands there. Then new
        single-bundle placement groups, for growth beyond the original reservation."""
        import ray
        from ray.util.placement_group import placement_group

        if n <= 0 or timeout_s <= 0:
            return
        deadline = time.monotonic() + timeout_s
        bundle = self._bundle()
        placed: list[WorkerRec] = []
        reuse, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        by_pg: dict[int, tuple[Any, list[int]]] = {}
        for pg, idx in reuse:
            by_pg.setdefault(id(pg), (pg, []))[1].append(idx)
        for pg, idxs in by_pg.values():
            placed += self._start_workers(pg, idxs, bundle,
                                          wait_s=max(0.5, deadline - time.monotonic()))
        need = n - len(placed)
        if need > 0:
            pgs = [placement_group([dict(bundle)]) for _ in range(need)]
            ray.wait([pg.ready() for pg in pgs], num_returns=need,
                     timeout=max(0.1, deadline - time.monotonic()))
            for pg in pgs:
                if pg_ready(pg):
                    placed += self._start_workers(pg, [0], bundle, wait_s=30)
                else:
                    ray.util.remove_placement_group(pg)
        if placed:
            self._emit("joined", f"{len(placed)} worker(s) placed on node(s) "
                       f"{sorted({str(w.info.get('node_id'))[:8] for w in placed})}")

    def _scale_interval(self) -> float:
        """Seconds between checks for room: ``scale_check_s``, but at most 1 s while the job
        is below its target size (after a loss the replacement node usually comes within
        seconds; the check is one GCS call)."""
        if len(self.workers) < self._target_world:
            return min(1.0, self.cfg.scale_check_s)
        return self.cfg.scale_check_s

    def _room_to_grow(self) -> bool:
        """Cheap check: fewer workers than the target, and a free reserved slot or enough
        free resources for one more worker somewhere."""
        import ray

        if len(self.workers) + len(self._warming) >= self._target_world:
            return False
        if self._free_slots:
            return any(pg_ready(pg) for pg, _ in self._free_slots)
        need = self._bundle()
        free = ray.available_resources()
        return all(free.get(k, 0.0) >= v for k, v in need.items() if v > 0)

    def _resize(self, n: int, reason: str, warm_only: bool = False) -> None:
        """At a step boundary: grow (take in new workers; they get the state from their
        peers, not from storage) or shrink to ``n`` workers, keeping the trajectory.
        ``warm_only``: grow only by warm spares that are already up (never wait)."""
        import ray

        t0 = time.time()
        old = list(self.workers)
        if n == len(old):
            return
        if warm_only and n > len(old) and not self._warm_ready():
            return
        self.state = ControllerState.RECOVERING
        ray.get([w.handle.snapshot_full.remote() for w in old])  # every old rank holds it all
        progress = ray.get([w.handle.progress.remote() for w in old])
        held = ray.get([w.handle.held_keys.remote() for w in old])
        if n > len(old):
            self._take_warm(n - len(old))
            if not warm_only:
                self._try_place(n - len(self.workers),
                                timeout_s=max(30.0, self.cfg.replacement_timeout_s))
            if len(self.workers) == len(old):
                if not warm_only:
                    self._emit("scale_failed", f"no room for more workers ({reason})")
                return
        else:
            for w in self.workers[n:]:
                ray.kill(w.handle)
            self.workers = self.workers[:n]
            progress, held = progress[:n], held[:n]
        ray.get([w.handle.leave.remote() for w in self.workers if w in old])
        self._form_group()
        spec = self._fit_spec(self._target_strategy(), len(self.workers))
        source, step, detail = self._restore(spec, progress, held)
        self.spec = spec
        self.step = step
        self._emit("scaled", f"{len(old)} -> {len(self.workers)} workers ({reason}) in "
                   f"{time.time() - t0:.2f}s, state from {source}{detail}",
                   data={"from": len(old), "to": len(self.workers), "source": source,
                         "seconds": time.time() - t0, "strategy": spec.name})
