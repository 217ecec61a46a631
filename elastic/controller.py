"""The controller: an explicit state machine that places workers, forms the group, lays out the
strategy, lets the workers train, and acts at step boundaries (switches, checkpoints, failures).

It is not in the step path: workers run whole segments of steps; the controller polls their
metrics a few times a second and feeds the view and the run log.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strategies import StrategySpec
from strategies import get as get_strategy
from strategies.base import StrategyError

from .config import JobConfig
from .data import even_shares, share_bounds
from .errors import (
    ClusterError,
    ConfigError,
    ElasticError,
    InfrastructureError,
    SwitchError,
    WorkerError,
)
from .events import Event, RunLog
from .reference import build_model
from .view import View

__all__ = ["Controller", "ControllerState", "FitResult", "Request"]

_POLL_S = 0.25  # while the controller has work at hand (see Controller._poll_interval)
_IDLE_POLL_S = 1.0  # otherwise: each poll is an RPC every worker answers, taking the GIL


def _read_detail(outs: list[dict[str, Any]]) -> str:
    """What each worker read of a checkpoint: only its new shard's part of the state."""
    if not outs:
        return ""
    mb = [o["bytes"] / 1e6 for o in outs]
    total = outs[0]["total_bytes"] / 1e6
    return f" (each worker read {min(mb):.1f}-{max(mb):.1f} of {total:.1f} MB)"


class ControllerState(enum.Enum):
    STARTING = "starting"
    PLACING = "placing"
    FORMING = "forming"
    RUNNING = "running"
    SWITCHING = "switching"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.FAILED)


@dataclass
class Request:
    """A request posted to a running controller (from the SDK handle, CLI or planner)."""

    kind: str  # "switch" | "stop" | "scale"
    value: Any = None
    reason: str = "requested"
    reply: queue.Queue[Any] | None = None
    remote_id: int | None = None  # set when the request came through the control actor


@dataclass
class FitResult:
    """What ``fit`` returns: final state, per-step history, events, and where logs are."""

    final_state: dict[str, Any]
    history: list[dict[str, Any]]
    events: list[Event]
    run_dir: str
    status: str = "finished"

    def state_dict(self) -> dict[str, Any]:
        """The final model parameters and buffers: FQN -> CPU tensor (plain PyTorch)."""
        return {k[len("model/"):]: v for k, v in self.final_state.items() if k.startswith("model/")}

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else float("nan")


@dataclass
class _WorkerRec:
    handle: Any
    worker_id: int
    info: dict[str, Any] = field(default_factory=dict)
    rank: int = -1
    pg: Any = None
    slot: int = 0  # bundle index in ``pg``


class Controller:
    """Runs one job to completion. Owns its Ray workers and placement groups; owns Ray itself
    only when it started a local cluster. Not thread-safe except ``post``."""

    def __init__(self, config: JobConfig, view: View | None = None,
                 on_step: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """``on_step(entry)`` is called in the controller's thread for every completed step
        (the history entry); if it returns True the job stops at the next step boundary
        (an Optuna pruner uses this)."""
        config.validate()
        self.on_step = on_step
        self.cfg = config
        self.view = view or View()
        self.state = ControllerState.STARTING
        self.requests: queue.Queue[Request] = queue.Queue()
        self.events: list[Event] = []
        self.history: list[dict[str, Any]] = []
        self.workers: list[_WorkerRec] = []
        self.generation = 0
        self.spec: StrategySpec | None = None
        self.step = 0
        self._started_ray = False
        self._next_worker_id = 0
        self._log: RunLog | None = None
        self._probe_model: Any = None
        self._use_gpu = False
        self._control: Any = None
        self.failures = 0
        self._free_slots: list[tuple[Any, int]] = []  # reserved bundles without a worker
        # workers starting in the background for room that appeared (warm spares): taken in
        # once up, so a scale-up pauses training only to form the group and hand over state
        self._warming: list[tuple[_WorkerRec, Any]] = []
        self._speed: dict[int, float] = {}  # worker_id -> measured samples/s
        self._mem_at = 0.0
        self._used_speeds: list[float] | None = None  # the speeds the current shares follow
        self._running: list[tuple[_WorkerRec, Any]] = []  # the segment's (worker, future)
        self._store: Any = None
        self._resume: tuple[Any, int] | None = None  # (store, step) to start from
        self._ckpt: dict[str, Any] | None = None  # the checkpoint in flight
        self._start_error = ""  # why the last worker that failed to start failed
        self._target_world = config.max_workers if config.max_workers is not None else \
            config.num_workers

    # ------------------------------------------------------------------ public

    def post(self, req: Request) -> None:
        """Thread-safe: queue a request for the next step boundary, and ask the workers to
        stop there now rather than at the controller's next poll (up to 1 s away when idle)."""
        self.requests.put(req)
        if self.state is ControllerState.RUNNING:
            for w in list(self.workers):
                try:
                    w.handle.request_stop.remote()
                except Exception:  # a dead worker: failure handling sees it
                    pass

    def run(self) -> FitResult:
        cfg = self.cfg
        self._preflight()
        self._log = RunLog(cfg.run_path)
        self._log.write_config(cfg.to_dict())
        self.view.start(cfg.job_name, cfg.max_steps)
        try:
            self._connect()
            from . import control

            self._control = control.create(cfg.job_name)
            self._emit("start", f"job {cfg.job_name}: {cfg.max_steps} steps, global batch "
                       f"{cfg.global_batch_size}, {cfg.num_workers} workers, strategy {cfg.strategy}")
            self._place(cfg.num_workers)
            self._form_group()
            self._layout(self._make_spec(cfg.strategy, len(self.workers)), reason="start")
            if self._resume is not None:
                self._restore_from(*self._resume, reason="resume")
            self.state = ControllerState.RUNNING
            while self.step < cfg.max_steps:
                end = self._segment_end()
                try:
                    self.step = self._run_segment(self.step, end)
                    self._at_boundary()
                except InfrastructureError as e:
                    self._recover(e)
            self._finish_checkpoint()
            final = self._final_state()
            self.state = ControllerState.FINISHED
            last = self.history[-1]["loss"] if self.history else float("nan")
            self._emit("finished", f"{cfg.max_steps} steps, final loss {last:.4f}")
            return FitResult(final, self.history, self.events, cfg.run_path)
        except BaseException as e:
            self.state = ControllerState.FAILED
            if isinstance(e, ElasticError):
                self._emit("failed", str(e).splitlines()[0])
            raise
        finally:
            self._cleanup()
            self.view.close()
            if self._log:
                self._log.close()

    # ------------------------------------------------------------------ start-up

    def _preflight(self) -> None:
        """Everything that can fail without Ray: build the model, look at the dataset."""
        cfg = self.cfg
        try:
            self._probe_model = build_model(cfg.model_factory(), cfg.seed)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError("model", f"the model factory raised {type(e).__name__}: {e}",
                              "fix the factory; it must return an nn.Module") from e
        ds = cfg.dataset_object()
        try:
            n = len(ds)
        except Exception as e:
            raise ConfigError("dataset", f"cannot read the dataset's length ({e}).",
                              "check the dataset URI or object") from e
        if n < cfg.global_batch_size:
            raise ConfigError(
                "dataset", f"has {n} samples, fewer than one global batch ({cfg.global_batch_size}).",
                f"use global_batch_size <= {n} or a larger dataset",
            )
        cfg.optimizer_factory()
        cfg.loss_fn()
        addr = cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if addr and addr not in ("local", "auto"):
            _check_reachable(addr)
        if cfg.strategy != "auto":
            self._validate_spec(self._make_spec(cfg.strategy, cfg.num_workers), "strategy")
        if cfg.checkpoint_every > 0 or cfg.checkpoint_uri:
            from .checkpoint_io import job_store

            self._store = job_store(cfg)
            self._store.check_writable()
        if cfg.resume:
            self._resume = self._find_resume(cfg.resume)

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        addr = self.cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if addr and addr not in ("local", "auto"):
            _check_reachable(addr)
            try:
                ray.init(address=addr, logging_level="ERROR", log_to_driver=False)
            except Exception as e:
                raise ClusterError(
                    f"cannot connect to the Ray cluster at {addr}: {e}. Fix: check the address "
                    "or start a cluster with `ray start --head`, or unset RAY_ADDRESS for a "
                    "local one."
                ) from e
        elif addr == "auto":
            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        else:
            need = self.cfg.max_world * float(self.cfg.resources_per_worker.get("CPU", 1))
            ray.init(address="local", num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
                     include_dashboard=False, logging_level="ERROR", log_to_driver=False)
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

    def _place(self, n: int) -> list[_WorkerRec]:
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
                       wait_s: float | None = None) -> list[_WorkerRec]:
        """Start one worker in each bundle ``slots`` of ``pg``. With ``wait_s``, workers that
        are not up by then are given up (their slot stays free) instead of waited for."""
        return self._collect(self._launch(pg, slots, bundle), wait_s)

    def _launch(self, pg: Any, slots: list[int], bundle: dict[str, float]
                ) -> list[tuple[_WorkerRec, Any]]:
        """Create the worker actors (non-blocking); returns (worker, ref of its info)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import Worker

        remote_cls = ray.remote(Worker)
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
            rec = _WorkerRec(h, wid, pg=pg, slot=i)
            new.append((rec, h.info.remote()))
        return new

    def _collect(self, launched: list[tuple[_WorkerRec, Any]], wait_s: float | None
                 ) -> list[_WorkerRec]:
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
                lines = str(_unwrap(e)).strip().splitlines()
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
        ready_slots = [(pg, i) for pg, i in self._free_slots if _pg_ready(pg)][:need]
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

    def _take_warm(self, n: int) -> list[_WorkerRec]:
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

    # ------------------------------------------------------------------ layout

    def _make_spec(self, name: str, world: int) -> StrategySpec:
        """The layout for ``name`` on ``world`` workers: batch shares follow measured speeds
        when balancing (dp and ZeRO), pipeline stages follow layer costs and stage speeds,
        and ``auto`` asks the planner."""
        from .planning import auto_spec, balanced_shares, speed_stage_split

        cfg = self.cfg
        g = cfg.global_batch_size
        placed = bool(self.workers) and len(self.workers) == world
        if name == "auto":
            if not placed:  # before placement: validated again once workers exist
                return StrategySpec("dp", world, even_shares(g, world))
            speeds = self._speeds()
            details, links = self._measure_details()
            spec, why = auto_spec(self._probe_model, cfg.optimizer, [w.info for w in self.workers],
                                  speeds, g, details=details, links=links)
            self._emit("plan", why.splitlines()[0], data={"explanation": why,
                                                          "speeds": speeds, "links": links})
            return spec
        pp = cfg.pp_degree
        if name == "pipeline" and pp == 1:
            pp = world
        shares = even_shares(g, world)
        split = None
        if placed and self._balancing():
            speeds = self._speeds()
            if name in ("dp", "zero1", "zero2", "zero3"):
                shares = balanced_shares(g, speeds)
                self._used_speeds = speeds
            elif name == "pipeline" and cfg.schedule != "interleaved" and world % pp == 0:
                d = world // pp
                try:
                    split = speed_stage_split(self._probe_model,
                                              [min(speeds[s * d:(s + 1) * d]) for s in range(pp)])
                except Exception:  # fewer blocks than stages: the strategy's check says so
                    split = None
        return StrategySpec(
            name=name, world_size=world, shares=shares, pp_degree=pp,
            micro_batches=cfg.micro_batches, schedule=cfg.schedule, dp_mode=cfg.dp_mode,
            stage_split=split,
        )

    def _fit_spec(self, name: str, world: int) -> StrategySpec:
        """A valid layout for ``name`` on ``world`` workers after a membership change: the
        same strategy if it can run there (a pipeline keeps its degree when it divides the
        world, else takes the nearest degree that does), else the planner's choice."""
        candidates = [self._make_spec(name, world)]
        if name == "pipeline":
            want = candidates[0].pp_degree
            degrees = sorted((d for d in range(2, world + 1) if world % d == 0),
                             key=lambda d: (abs(d - want), d))
            candidates += [dataclasses.replace(candidates[0], pp_degree=d) for d in degrees]
        for spec in candidates:
            try:
                get_strategy(spec.name).validate(spec, self._probe_model)
                if spec is not candidates[0]:
                    self._emit("replanned", f"{name} with pp_degree {spec.pp_degree} on {world} "
                               f"workers (pp_degree {candidates[0].pp_degree} does not fit)")
                return spec
            except StrategyError:
                continue
        spec = self._make_spec("auto", world)
        self._emit("replanned", f"{name} cannot run on {world} workers; the planner chose "
                   f"{spec.name}")
        return spec

    def _balancing(self) -> bool:
        if self.cfg.balance == "on":
            return True
        if self.cfg.balance == "off":
            return False
        kinds = {(w.info.get("device_name"), w.info.get("emulated")) for w in self.workers}
        return len(kinds) > 1 or any(w.info.get("emulated") for w in self.workers)

    def _speeds(self, force: bool = False) -> list[float]:
        """Measured samples/s of each worker, in rank order. Profiled once per worker (or
        taken from the profile cache, keyed by device, emulation, model and batch); ``force``
        measures again (drift checks)."""
        import ray

        from .profiles import ProfileCache

        batch = max(1, self.cfg.global_batch_size // max(1, len(self.workers)))
        cache = ProfileCache() if self.cfg.profile_cache else None
        todo = []
        for w in self.workers:
            if w.worker_id in self._speed and not force:
                continue
            key = ProfileCache.key(w.info, self._probe_model, batch)
            hit = cache.get(key) if cache is not None and not force else None
            if hit is not None:
                self._speed[w.worker_id] = hit
                w.info["profiled_samples_per_s"] = hit
            else:
                todo.append((w, key))
        if todo:
            outs = ray.get([w.handle.profile.remote(batch) for w, _ in todo])
            for (w, key), o in zip(todo, outs, strict=True):
                self._speed[w.worker_id] = o["samples_per_s"]
                w.info["profiled_samples_per_s"] = o["samples_per_s"]
                if cache is not None:
                    cache.put(key, o["samples_per_s"])
            self._emit("profiled", "samples/s per worker: " + ", ".join(
                f"{w.worker_id}:{self._speed[w.worker_id]:.0f}" for w in self.workers))
        return [self._speed[w.worker_id] for w in self.workers]

    def _measure_details(self) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
        """For the planner: per-block timings and activation sizes on every worker, and the
        all-reduce time between them for a few sizes (alpha-beta fit of the live links)."""
        import ray

        batch = max(1, self.cfg.global_batch_size // max(1, len(self.workers)))
        details = ray.get([w.handle.profile.remote(batch, True) for w in self.workers])
        links: list[tuple[int, float]] = []
        if len(self.workers) > 1:
            sizes = [4 << 10, 256 << 10, 4 << 20]
            outs = ray.get([w.handle.measure_collectives.remote(sizes) for w in self.workers])
            links = [(n, max(o[i][1] for o in outs)) for i, (n, _) in enumerate(outs[0])]
            self._emit("links", "all-reduce " + ", ".join(
                f"{n >> 10} KiB {t * 1e3:.2f} ms" for n, t in links), data={"points": links})
        return details, links

    def _maybe_rebalance(self) -> None:
        """Every ``rebalance_every`` steps while balancing dp/ZeRO shares: measure the speeds
        again and re-cut the shares if they drifted (``clusters.rebalance_decision``)."""
        from clusters import rebalance_decision

        spec = self.spec
        every = self.cfg.rebalance_every
        if (spec is None or every <= 0 or self.step % every or not self._balancing()
                or spec.name not in ("dp", "zero1", "zero2", "zero3")):
            return
        used = self._used_speeds or [1.0] * spec.world_size
        measured = self._speeds(force=True)
        decision = rebalance_decision(spec.shares, used, measured)
        if not decision.rebalance:
            return
        self._used_speeds = measured
        self._layout(dataclasses.replace(spec, shares=decision.shares),
                     reason=f"rebalance: {decision.reason}")
        self._emit("rebalanced", f"shares {list(spec.shares)} -> {list(decision.shares)}: "
                   f"{decision.reason}", data={"from": list(spec.shares),
                                               "to": list(decision.shares),
                                               "drift": decision.drift, "gain": decision.gain})

    def _validate_spec(self, spec: StrategySpec, field_name: str) -> None:
        try:
            get_strategy(spec.name).validate(spec, self._probe_model)
        except StrategyError as e:
            raise ConfigError(field_name, f"{spec.name} cannot run here: {e}",
                              "choose another strategy, world size or batch settings") from None

    def _layout(self, spec: StrategySpec, reason: str) -> None:
        """Lay the workers out as ``spec`` (first build, or a live in-memory switch)."""
        import ray

        old = self.spec
        first = old is None
        self.state = ControllerState.RUNNING if first else ControllerState.SWITCHING
        t0 = time.perf_counter()
        try:
            outs = ray.get([w.handle.build.remote(spec) for w in self.workers])
        except Exception as e:
            cause = _unwrap(e)
            if first:
                raise cause from None
            raise SwitchError(f"switch to {spec.name} failed: {cause}") from None
        dt = time.perf_counter() - t0
        if first:
            self.spec = spec
            self._emit("layout", f"{spec.name} on {spec.world_size} workers, shares "
                       f"{list(spec.shares)} ({dt:.2f}s)", data={"strategy": spec.name})
            return
        hashes = {(o["hash_before"], o["hash_after"]) for o in outs}
        same = all(b == a for b, a in hashes) and len({b for b, _ in hashes}) == 1
        mode = outs[0].get("check", "rehash")
        how = {"pieces": "every rank's new pieces bit-equal to it",
               "rehash": "gathered and hashed again"}.get(mode)
        check = ((f"unchanged ({how})" if same else "CHANGED") if how
                 else "not re-checked (switch_check: off)")
        problems = sorted({p for o in outs for p in o.get("problems", [])})
        move = outs[0].get("move", "gather")
        sent = sum(int(o.get("bytes_sent", 0)) for o in outs)
        moved = (f", {sent / 1e6:.1f} MB moved between ranks" if move == "reshard"
                 else ", full state gathered on every rank")
        self._emit("switch", f"{old.name if old else '-'} -> {spec.name} ({reason}) in {dt:.2f}s"
                   f"{moved}, state digest {sorted(hashes)[0][0]} {check}",
                   data={"from": old.name if old else None, "to": spec.name, "reason": reason,
                         "seconds": dt, "hashes": sorted(hashes), "state_preserved": same,
                         "check": mode, "move": move, "bytes_moved": sent,
                         "problems": problems[:10]})
        if not same:  # the workers kept (or went back to) the old layout
            raise SwitchError(f"state changed during the switch to {spec.name}: "
                              f"{problems[:3] or sorted(hashes)}; the job stays on {old.name}")
        self.spec = spec

    def switch(self, name: str, reason: str) -> None:
        spec = self._make_spec(name, len(self.workers))
        try:
            get_strategy(name).validate(spec, self._probe_model)
        except StrategyError as e:
            self._emit("switch_refused", f"{name}: {e}")
            raise SwitchError(f"cannot switch to {name}: {e}") from None
        self._layout(spec, reason)

    # ------------------------------------------------------------------ steady state

    def _segment_end(self) -> int:
        ends = [self.cfg.max_steps]
        ends += [s for s in self.cfg.switch_at if s > self.step]
        every = self.cfg.rebalance_every
        if every > 0 and self.workers and self._balancing():
            ends.append((self.step // every + 1) * every)
        return min(ends)

    def _run_segment(self, start: int, end: int) -> int:
        import ray

        self.state = ControllerState.RUNNING
        futs = [w.handle.run.remote(start, end) for w in self.workers]
        self._running = list(zip(self.workers, futs, strict=True))
        stop_sent = False
        next_check = time.monotonic() + self._scale_interval()
        while True:
            done, pending = ray.wait(futs, num_returns=len(futs),
                                     timeout=self._poll_interval())
            if done and pending:
                self._raise_if_failed(done, pending)
            self._drain()
            self._poll_control()
            self._checkpoint_tick()
            if not pending:
                break
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._scale_interval()
                if self._warm_ready() and len(self.workers) < self._target_world:
                    self.post(Request("grow", reason="a node with room joined"))
                elif self._room_to_grow():
                    self._warm_up()
            if not stop_sent and not self.requests.empty():
                for w in self.workers:
                    w.handle.request_stop.remote()
                stop_sent = True
        try:
            results = ray.get(futs)
        except Exception:
            self._raise_if_failed(futs, [])
            raise
        self._drain()
        self._checkpoint_tick()
        return int(results[0]["next_step"])

    def _raise_if_failed(self, done: list[Any], pending: list[Any]) -> None:
        """If a finished segment failed, raise its root cause at once: a user error on one
        rank leaves its peers blocked in a collective, so waiting for them would only wait
        out the hang timeout."""
        import ray

        errors: list[BaseException] = []
        for f in done:
            try:
                ray.get(f)
            except Exception as e:
                errors.append(_unwrap(e))
        if not errors:
            return
        if pending:  # give peers a moment to report a more specific cause
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for f in more:
                try:
                    ray.get(f)
                except Exception as e:
                    errors.append(_unwrap(e))
        user = [e for e in errors if isinstance(e, WorkerError)]
        raise (user[0] if user else errors[0])

    def _drain(self) -> None:
        import ray

        batches = []
        refs = [w.handle.drain.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        answered = set(ready)
        for ref in refs:
            if ref not in answered:  # a dead or stuck worker: failure handling takes over
                batches.append([])
                continue
            try:
                batches.append(ray.get(ref))
            except Exception as e:
                if isinstance(_unwrap(e), WorkerError):
                    raise _unwrap(e) from None
                batches.append([])
        per_step: dict[int, dict[str, Any]] = {}
        for w, batch in zip(self.workers, batches, strict=True):
            for m in batch:
                w.info["samples_per_s"] = m["samples"] / m["step_time"] if m["step_time"] else 0
                w.info["share"] = m["samples"]
                if m["step"] not in per_step or m["rank"] == 0:
                    per_step[m["step"]] = m
                if "checkpoint_begun" in m:
                    ck = self._ckpt
                    if ck is None or ck["step"] != m["checkpoint_begun"]:
                        ck = self._ckpt = {"step": m["checkpoint_begun"], "blocked_s": 0.0,
                                           "spec": self.spec, "t0": time.time()}
                    ck.setdefault("by_rank", {})[m["rank"]] = m["checkpoint_blocked_s"]
                    ck["blocked_s"] = max(ck["by_rank"].values())
                if m.get("checkpoint_wait_s"):  # the next update waited for the host copy
                    self._checkpoint_wait(m["rank"], float(m["checkpoint_wait_s"]))
                if m.get("checkpoint_skipped") and m["rank"] == 0:
                    self._emit("checkpoint_skipped", f"step {m['checkpoint_skipped']}: the "
                               "previous checkpoint is still uploading")
        for st in sorted(per_step):
            self._record_step(st, per_step[st])
        if per_step and time.monotonic() - self._mem_at > 2.0:  # memory column of the view
            self._mem_at = time.monotonic()
            refs = [w.handle.memory_counts.remote() for w in self.workers]
            for w, ref in zip(self.workers, refs, strict=True):
                try:
                    counts = ray.get(ref, timeout=10)
                    w.info["memory"] = {k: v * 4 for k, v in counts.items()}  # fp32 bytes
                except Exception:
                    pass
        if per_step:
            self.view.workers([w.info for w in self.workers])

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

    def _record_step(self, step: int, m: dict[str, Any] | None, spec: StrategySpec | None = None,
                     generation: int | None = None) -> None:
        """Record a completed step once: history, metrics log, view, and the data log line
        saying which rank trained which sample range of it (from the plan in force)."""
        spec = spec or self.spec
        assert spec is not None and self._log is not None
        if self.history and step <= self.history[-1]["step"]:
            return
        gen = m["generation"] if m else (generation or self.generation)
        entry = {"step": step, "loss": m["loss"] if m else float("nan"),
                 "samples_per_s": m["samples_per_s"] if m else 0.0,
                 "step_time": m["step_time"] if m else 0.0, "world_size": spec.world_size,
                 "strategy": spec.name, "time": m["time"] if m else time.time(),
                 "generation": gen}
        if m is None:
            entry["note"] = "completed while a worker was lost; its loss was not reported"
        self.history.append(entry)
        self._log.metric(entry)
        bounds = [share_bounds(spec.shares, r) for r in range(spec.world_size)]
        self._log.data({"step": step, "generation": gen, "ranges": bounds,
                        "global_samples": m["global_samples"] if m else None})
        self.view.step(entry)
        if self.on_step is not None and m is not None and self.on_step(entry) is True:
            if not any(r.kind == "stop" for r in list(self.requests.queue)):
                self.post(Request("stop", reason="the on_step callback asked to stop"))

    def _poll_control(self) -> None:
        """Publish status and take requests posted through the control actor."""
        if self._control is None:
            return
        import ray

        self._control.set_status.remote(self.status())
        try:
            taken = ray.get(self._control.take.remote(), timeout=10)
        except Exception as e:  # the mailbox is a convenience: losing it must not stop training
            self._emit("control_lost", f"the job's control actor failed ({type(e).__name__}); "
                       "remote control is off for this job, the SDK handle still works")
            self._control = None
            return
        for r in taken:
            self.post(Request(r["kind"], r["value"], r["reason"] or "requested remotely",
                              remote_id=r["id"]))

    def _at_boundary(self) -> None:
        if self.step >= self.cfg.max_steps:
            return
        if self.step in self.cfg.switch_at:
            self.switch(self.cfg.switch_at[self.step], reason=f"switch_at {self.step}")
        else:
            self._maybe_rebalance()
        while not self.requests.empty():
            req = self.requests.get_nowait()
            result: Any = None
            try:
                if req.kind == "switch":
                    self.switch(str(req.value), reason=req.reason)
                    result = self.spec.name if self.spec else None
                elif req.kind == "grow":
                    self._resize(self._target_world, reason=req.reason, warm_only=True)
                    result = len(self.workers)
                elif req.kind == "scale":
                    n = int(req.value)
                    if not self.cfg.min_world <= n <= self.cfg.max_world:
                        raise SwitchError(
                            f"cannot scale to {n} workers: outside min_workers..max_workers = "
                            f"{self.cfg.min_world}..{self.cfg.max_world}")
                    self._target_world = n
                    self._resize(n, reason=req.reason)
                    result = len(self.workers)
                elif req.kind == "memory":
                    import ray

                    result = ray.get([w.handle.memory_counts.remote() for w in self.workers])
                elif req.kind == "stop":
                    self._emit("stopped", f"stopped on request at step {self.step}")
                    self.cfg.max_steps = self.step
                    result = "stopped"
                else:
                    result = SwitchError(f"unknown request {req.kind!r}")
            except SwitchError as e:
                result = e
            if req.reply is not None:
                req.reply.put(result)
            if req.remote_id is not None and self._control is not None:
                out = {"error": str(result)} if isinstance(result, BaseException) else {
                    "ok": True, "result": result, "status": self.status()}
                self._control.reply.remote(req.remote_id, out)

    def _final_state(self) -> dict[str, Any]:
        import ray

        outs = ray.get([w.handle.full_state.remote(want=(w.rank == 0)) for w in self.workers])
        return outs[0]

    # ------------------------------------------------------------------ checkpoints

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
                plan=_spec_dict(spec), world_size=spec.world_size, data_position=step,
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
                f"resume={resume!r}: no committed checkpoint under {store.uri}"
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
            raise _unwrap(e) from None
        self.step = step
        self._emit("resumed" if reason == "resume" else "restored",
                   f"from checkpoint step {step} at {store.uri} in {time.time() - t0:.2f}s"
                   f"{_read_detail(outs)}",
                   data={"step": step, "uri": store.uri,
                         "bytes_read": [o["bytes"] for o in outs],
                         "state_bytes": outs[0]["total_bytes"] if outs else 0})

    # ------------------------------------------------------------------ scaling

    def _poll_interval(self) -> float:
        """Seconds between polls of a running segment. Each poll drains every worker's metrics
        by an RPC its second thread answers, taking the GIL from the training thread: at 4
        polls/s that cost ~7 % of a 2-core host's throughput (docs/benchmarks.md). So poll fast
        only while it matters: a checkpoint in flight (its commit rides on the poll), frequent
        checkpoints (under 5 s apart: a late commit would make the next one skip), a waiting
        request, the job below its target size, or before the first step is seen. Failures do
        not wait for a poll: ``ray.wait`` returns as soon as a segment ends."""
        if self._ckpt is not None or not self.requests.empty() or not self.history:
            return _POLL_S
        if len(self.workers) < self._target_world:
            return _POLL_S
        every = self.cfg.checkpoint_every
        step_s = float(self.history[-1].get("step_time") or 0.0)
        if every > 0 and every * step_s < 5.0:
            return _POLL_S
        return _IDLE_POLL_S

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
            return any(_pg_ready(pg) for pg, _ in self._free_slots)
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

    # ------------------------------------------------------------------ failures

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

    def _hung_workers(self) -> list[_WorkerRec]:
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

    def _survivors(self, exclude: list[_WorkerRec] = ()) -> tuple[list[_WorkerRec],
                                                                  list[_WorkerRec]]:
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
        placed: list[_WorkerRec] = []
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
                if _pg_ready(pg):
                    placed += self._start_workers(pg, [0], bundle, wait_s=30)
                else:
                    ray.util.remove_placement_group(pg)
        if placed:
            self._emit("joined", f"{len(placed)} worker(s) placed on node(s) "
                       f"{sorted({str(w.info.get('node_id'))[:8] for w in placed})}")

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
                f", checkpoint step {manifest.step} read in {took:.2f}s{_read_detail(outs)}")

    # ------------------------------------------------------------------ events and cleanup

    def _emit(self, kind: str, message: str, data: dict[str, Any] | None = None,
              step: int | None = None) -> None:
        ev = Event(kind, message, step=self.step if step is None else step, data=data or {})
        self.events.append(ev)
        if self._log:
            self._log.event(ev)
        self.view.event(ev)

    def status(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        done = last["step"] + 1 if last else self.step
        return {"job": self.cfg.job_name, "state": self.state.value, "step": done,
                "max_steps": self.cfg.max_steps, "strategy": self.spec.name if self.spec else None,
                "world_size": len(self.workers), "loss": last.get("loss"),
                "samples_per_s": last.get("samples_per_s")}

    def _cleanup(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        warm = [w for w, _ in self._warming]
        self._warming = []
        for w in self.workers + warm:
            try:
                ray.kill(w.handle)
            except Exception:
                pass
        pgs = [w.pg for w in self.workers + warm] + [pg for pg, _ in self._free_slots]
        for pg in {id(pg): pg for pg in pgs if pg is not None}.values():
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        self.workers = []
        while not self.requests.empty():  # nobody is left to act on these
            req = self.requests.get_nowait()
            gone = SwitchError(f"the job ended ({self.state.value}) before the request was handled")
            if req.reply is not None:
                req.reply.put(gone)
            if req.remote_id is not None and self._control is not None:
                self._control.reply.remote(req.remote_id, {"error": str(gone)})
        if self._control is not None:
            try:  # let askers collect their replies (bounded) before the mailbox goes away
                self._control.set_status.remote(self.status())
                deadline = time.monotonic() + 3.0
                while ray.get(self._control.unread_replies.remote()) and time.monotonic() < deadline:
                    time.sleep(0.1)
                ray.kill(self._control)
            except Exception:
                pass
            self._control = None
        if self._started_ray:
            ray.shutdown()


def _spec_dict(spec: StrategySpec) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(spec)
    d["shares"] = list(spec.shares)
    return d


def _pg_ready(pg: Any) -> bool:
    """Whether every bundle of ``pg`` is reserved now (no task is started to find out:
    ``pg.ready()`` makes a new task each call, which a zero timeout never sees finish)."""
    import ray

    try:
        return ray.util.placement_group_table(pg).get("state") == "CREATED"
    except Exception:
        return False


def _unwrap(e: BaseException) -> BaseException:
    """Turn Ray's wrapper exceptions into ours: user errors stay WorkerError, the rest are
    InfrastructureError."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(e, RayTaskError):
        cause = e.cause if hasattr(e, "cause") else None
        if isinstance(cause, (WorkerError, InfrastructureError, ElasticError)):
            return cause
        return InfrastructureError(str(e))
    if isinstance(e, RayActorError):
        return InfrastructureError(f"a worker died: {e}")
    return e


def _check_reachable(addr: str) -> None:
    host, _, port = addr.replace("ray://", "").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            pass
    except (OSError, ValueError) as e:
        raise ClusterError(
            f"cannot reach the Ray cluster at {addr} ({e}). Fix: start one with "
            "`ray start --head`, correct ray_address / RAY_ADDRESS, or unset it to run locally."
        ) from None
