"""The worker actor: one Ray actor per device, one rank of the current process group.

The actor is threaded (``max_concurrency=2``): ``run`` executes the training loop while the
controller drains metrics, asks for memory counts and posts stop requests through the second
thread (none of which touches the live tensors there: ``StepLoop``). Its methods are
the RPC surface the controller calls; each delegates to a component that owns its state
(membership, layout, held state, step loop, checkpointing, profiling, faults), and every call
that runs the job's code or a collective goes through the error boundary (``guarded``). This
is the package's only module that imports Ray (``info``, ``free_port``).

A pooled worker (``elastic.control.pool``) is started without a job, takes one with
``assign`` and goes back with ``reset`` (``elastic.worker.recycle``: what a next job can and
cannot see of the previous one).

Group lifecycle: ``join`` forms a group, ``leave`` tears it down. The model, optimizer and data
position survive ``leave``/``join`` (parked in ``HeldState``), which is what lets survivors
keep their memory when a node is lost.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import socket
import sys
import time
from typing import Any

import torch

from strategies import StrategySpec, health, state_hash

from ..config import JobConfig, WorkerConfig
from ..errors import ElasticError, WorkerError
from .boundary import guarded
from .checkpointing import Checkpointing, forget_groups
from .faults import Faults
from .handoff import hand_off
from .heartbeat import Heartbeat, raylet_parent
from .held_state import HeldState, PeerPlan
from .inputs import JobData
from .layout import Layout
from .loop import StepLoop
from .membership import Membership, nccl_env_defaults
from .peer_copies import PeerCopies
from .profiling import Profiler
from .recycle import Baseline, precision_changed, warm_up
from .recycle import reset as reset_process

__all__ = ["Worker"]

# the attributes ``Worker._setup`` builds for a job (dropped by ``reset``)
_JOB_PARTS = ("membership", "data", "held", "profiler", "layout", "copies", "faults",
              "checkpoints", "loop")


def _live_ray() -> Any:
    """Ray, when this process runs in it; else None (Ray may not be installed: bench/
    gpu_check.py on a GPU host, the unit tests). Never imports or starts it."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


@functools.cache
def _host_cores() -> int:
    """The cores this process may run on: its CPU affinity (all cores where there is none,
    off Linux), and no more than its cgroup's CPU quota (a container's limit)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = n or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and float(period) > 0:
            n = min(n, max(1, math.ceil(float(quota) / float(period))))
    except (OSError, ValueError):
        pass
    return n


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray). Never starts Ray: asked
    outside a Ray worker, ``get_runtime_context`` starts a local instance (a unit test's
    ``reset`` did, and the next tests found a 2-CPU Ray instead of their own)."""
    ray = _live_ray()
    if ray is None:
        return None
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - outside a Ray worker (a test, bench/gpu_check.py)
        return None


def _node_ip() -> str:
    """This node's address as Ray knows it; outside Ray the host's own."""
    ray = _live_ray()
    if ray is not None:
        return str(ray.util.get_node_ip_address())
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# a job whose set-up left more tracked objects than this (a large library its code imports)
# has them frozen as well, so ``leave``'s collection skips them, and its ``reset`` collects the
# whole heap again (unfreeze: ~0.16 s of CPU for torch's ~320k objects here, a tenth of a warm
# job's time in the tests); a small job's are left tracked, and its reset collects only them
_FREEZE_JOB_OVER = 20_000


def _freeze_job() -> bool:
    """At ``assign``: freeze what the job's set-up left if that is a lot; True if it did."""
    if len(gc.get_objects()) <= _FREEZE_JOB_OVER:
        return False
    gc.freeze()
    return True


def _freeze_start_up() -> None:
    """Start-up objects (torch, Ray, the job's modules) skip later collections, which keeps
    the one in ``leave`` short: a survivor's group closes at that collection, and a peer
    blocked on it waits for it. ``torch._dynamo`` is imported first: the first layout (DDP,
    FSDP, an optimizer's step) would import it anyway, and its ~117k objects, left unfrozen,
    made each collection 50-70 ms on an idle core and 0.1-2.75 s while a new node started on
    the same cores (bench/recovery.py); frozen, 0.1 ms."""
    import torch._dynamo  # noqa: F401

    gc.freeze()


SEGMENT_END_S = 2.0  # a reset's wait for a segment still running to end (twice at most)


class Worker:
    """Body of the worker actor (wrapped with ``ray.remote`` by the controller)."""

    def __init__(self, config: JobConfig | WorkerConfig | None, worker_id: int, use_gpu: bool,
                 num_threads: int, liveness: tuple[str, int, str] | None = None) -> None:
        """A job's worker, or (``config`` None) a pooled one waiting for ``assign``: its
        process is up, torch and the process group's machinery loaded and, on a GPU, CUDA's
        context created, and what the process looks like before any job is recorded for
        ``reset`` (``elastic.worker.recycle``)."""
        torch.set_num_threads(max(1, num_threads))
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        if use_gpu:
            nccl_env_defaults()  # before any NCCL group (membership.NCCL_ENV: why)
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # the context now, not in the first job
        self.warm_up_s = warm_up(self.device) if config is None else 0.0
        self.baseline = Baseline.take() if config is None else None
        self.jobs = 0  # jobs this process has served
        self._job_frozen = False  # whether the job's set-up objects were frozen (assign)
        self.user_error = False  # the current job's code raised here
        self.heartbeat: Heartbeat | None = None
        self._left: dict[str, float] = {}  # the last leave's timings (leave)
        if config is not None:
            self._setup(config, worker_id, liveness)
        _freeze_start_up()

    def _setup(self, config: JobConfig | WorkerConfig, worker_id: int,
               liveness: tuple[str, int, str] | None) -> None:
        """Build the job's components (the constructor's job part, and ``assign``'s)."""
        self.config = config
        self.worker_id = worker_id
        self.jobs += 1
        # the controller learns of this process's end (or its node's) from this connection first
        self.heartbeat = (Heartbeat(*liveness, worker_id, 0.1, node_pid=raylet_parent())
                          if liveness else None)
        if self.device.type == "cuda" and config.precision == "bf16" \
                and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"precision: bf16 is not supported by {torch.cuda.get_device_name()} "
                "(bf16 needs compute capability 8.0+: A100, H100, L4...); fix: use "
                "precision: fp32 for this cluster, or place the job on bf16 devices")
        model_factory, loss_fn = config.model_factory(), config.loss_fn()
        self.membership = Membership("nccl" if self.device.type == "cuda" else "gloo",
                                     self.device, copies=config.peer_copies_every > 0)
        self.data = JobData(config)
        self.held = HeldState()
        self.profiler = Profiler(config, self.device, self.data, model_factory, loss_fn)
        self.layout = Layout(config, self.membership, self.held, self.data, model_factory,
                             loss_fn, on_built=self.profiler.install)
        self.copies = PeerCopies(config.peer_copies_every, config.peer_copies_memory_gb,
                                 self.membership, _node_id)
        self.faults = Faults(config, node_id=_node_id, corrupt=self.copies.corrupt,
                             mute=self.heartbeat.mute if self.heartbeat else lambda: None,
                             slowdown=self.profiler.slow_down)
        self.checkpoints = Checkpointing(config, self.membership, self.layout, self.faults)
        self.loop = StepLoop(config, self.membership, self.layout, self.data, self.checkpoints,
                             self.profiler, self.faults, self.copies)

    def _guard(self, fn: Any, *args: Any) -> Any:
        if self.baseline is not None:  # a pooled worker: this thread as a fresh one's
            self.baseline.on_thread(self.jobs)
        try:
            return guarded(self.membership.rank, fn, *args)
        except WorkerError:
            self.user_error = True  # the pool retires this process (clusters.pool_policy)
            raise

    # ------------------------------------------------------------------ warm pool

    def assign(self, config: WorkerConfig, worker_id: int,
               liveness: tuple[str, int, str] | None) -> dict[str, Any]:
        """A pooled worker (built without a config, or ``reset``) takes a job: its
        components are built for ``config``, as the constructor does. Returns ``info()``."""
        if getattr(self, "config", None) is not None:
            raise ElasticError("this worker still serves a job: reset it before assign")
        try:
            self._setup(config, worker_id, liveness)
        except Exception:
            self.user_error = True  # the job's code failed to load or build here
            raise
        self._job_frozen = _freeze_job()
        return self.info()

    def reset(self) -> dict[str, Any]:
        """After a job: its group, components (model, optimizer, data, held state,
        checkpoint writer) and their tensors dropped, its heartbeat stopped, the process
        brought back to how it was before any job (``recycle.reset``). Returns what the
        pool's policy judges: ``ok``, ``user_error``, ``threads`` left running,
        ``segment_ran`` (a segment still ran, its group gone), ``cuda_left`` (GPU bytes past
        the process's own at its start), ``jobs``, ``pid``."""
        if self.baseline is None:
            raise ElasticError("only a pooled worker (built without a config) can be reset")
        ok, why = True, ""
        loop: Any = self.__dict__.get("loop")  # a segment left running is asked to stop
        running = loop is not None and not loop.wind_down(SEGMENT_END_S)
        try:
            if getattr(self, "config", None) is not None:
                stuck = self.checkpoints.close()
                if stuck:
                    ok, why = False, stuck
                # not parked: a copy of the rank's state to host memory, only to drop it,
                # could exhaust it (a large FSDP job) or pass the pool's 30 s reset limit
                self.leave(park=False)
        except Exception as e:  # noqa: BLE001 - said to the pool, which retires the worker
            ok, why = False, f"{type(e).__name__}: {e}"
        running = running and not loop.wait_idle(SEGMENT_END_S)  # (its group gone)
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        for name in _JOB_PARTS:  # every reference to the job's objects goes
            self.__dict__.pop(name, None)
        self.config = None  # type: ignore[assignment]
        forget_groups()
        health.reset()
        out = reset_process(self.baseline, unfreeze=self._job_frozen)
        self._job_frozen = False
        if ok and (changed := precision_changed(out)):
            ok, why = False, changed
        user_error, self.user_error = self.user_error, False
        return {**out, "ok": ok, "why": why, "user_error": user_error, "jobs": self.jobs,
                "pid": os.getpid(), "node_id": _node_id(), "segment_ran": running,
                "cuda_left": max(0, int(out.get("cuda_bytes") or 0) - self.baseline.cuda_bytes)}

    # ------------------------------------------------------------------ identity and group

    def info(self) -> dict[str, Any]:
        dev = self.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        prof = getattr(self, "profiler", None)  # None: a pooled worker between jobs
        emulation = prof.emulation if prof is not None else {}
        return {
            "worker_id": getattr(self, "worker_id", -1),
            "node_id": _node_id(),  # (never starts a Ray outside one: a unit test's did)
            "ip": _node_ip(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(dev),
            "device_name": prof.display_name(name) if prof is not None else name,
            "threads": torch.get_num_threads(),
            "host_cores": _host_cores(),
            "emulation": dict(emulation),
            "emulated": bool(emulation),
            "jobs": self.jobs,
            "warm_up_s": self.warm_up_s,
        }

    def free_port(self) -> int:
        """A port for the next group's store, listening on this node's address only (this
        worker will be rank 0)."""
        import ray

        return self.membership.open_port(ray.util.get_node_ip_address())

    def join(self, addr: str, port: int, rank: int, world: int, generation: int,
             timeout_s: float) -> float:
        """Form generation ``generation`` of the group; returns seconds taken."""
        t0 = time.perf_counter()
        self.leave()
        self.checkpoints.release_held(f"group generation {generation} formed")
        self.membership.join(addr, port, rank, world, generation, timeout_s)
        return time.perf_counter() - t0

    def leave(self, collect: bool = True, park: bool = True) -> dict[str, float]:
        """Tear down the current group, if any: the rank's state parked in memory (canonical
        CPU tensors; ``park=False``, at ``reset``: dropped), the strategy dropped with every
        reference it had to the group (a gloo group closes its sockets, and peers blocked on
        this rank fail at once, only when its last reference goes). Every path after a leave
        lays the job out again from parked, peer or checkpoint state. ``collect=False`` (a
        planned leave) skips the collection that frees the sockets at once (~0.2 s). Returns
        the last dropping leave's parts and this call's wait for the lock, in seconds
        (``park``, ``drop``, ``group``, ``gc``, ``lock``; bench/recovery.py reports them)."""
        t0 = time.perf_counter()
        with self.held.lock:
            t = [time.perf_counter()]
            dropped = self.layout.strategy is not None
            if dropped:
                if park:
                    self.held.park(self.layout.strategy)
                t.append(time.perf_counter())
                self.layout.drop()
                t.append(time.perf_counter())
            self.membership.leave()
            t.append(time.perf_counter())
            if dropped and collect:  # reference cycles (hooks, schedules) hold groups too
                gc.collect()
            t.append(time.perf_counter())
            if dropped:
                self._left = dict(zip(("park", "drop", "group", "gc"),
                                      (b - a for a, b in zip(t, t[1:], strict=False)),
                                      strict=True))
            return dict(self._left, lock=t[0] - t0)

    # ------------------------------------------------------------------ layout and training

    def build(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Lay the job out as ``spec``: from the live state when a strategy already runs
        (an in-memory switch), else from a fresh seeded model, then ``state`` if given."""
        return self._guard(self.layout.build, spec, state)

    def run(self, start: int, end: int, segment: int | None = None) -> dict[str, Any]:
        """Train steps ``start..end-1`` as the controller's segment ``segment``; stop early at
        a step boundary if any rank was asked (``StepLoop.run``).

        Returns ``{"status": "done"|"stopped", "next_step": n}``. Raises ``WorkerError`` for
        user-code failures (naming the step it was in) and ``GroupError`` for group failures.
        """
        try:
            return self._guard(self.loop.run, start, end, segment)
        except WorkerError as e:  # (a step's data, forward, loss, backward or update)
            if e.step is not None:
                raise
            raise WorkerError(e.rank, e.node, e.message, e.traceback_text,
                              step=self.loop.at_step,
                              during="the evaluation after it" if self.loop.at_eval
                              else None, part=self.loop.part_said()) from None

    def request_stop(self, segment: int | None = None, urgent: bool = False) -> None:
        """Ask segment ``segment`` to stop after the current step, whether or not it has
        started here yet (all ranks agree on the same step); ``urgent``: without waiting for
        a slow upload's commit at a due checkpoint (which is then skipped)."""
        self.loop.request_stop(segment, urgent)

    def set_gate(self, gate: Any) -> None:
        """A sweep pruner's decision handed ahead (``clusters.sweep_policy.PruneGate``)."""
        self.loop.set_gate(gate)

    def drain(self) -> list[dict[str, Any]]:
        return self.loop.drain()

    def full_state(self, want: bool = True) -> dict[str, torch.Tensor] | None:
        """Collective: every rank must call. Returns the canonical state if ``want``."""
        assert self.layout.strategy is not None
        self.faults.in_final(self.membership.rank, self.layout.next_step)
        st = self._guard(self.layout.strategy.full_state)
        return st if want else None

    def state_hash(self) -> str:
        assert self.layout.strategy is not None
        return state_hash(self._guard(self.layout.strategy.full_state))

    def memory_counts(self, wait_s: float = 2.0) -> dict[str, int]:
        """Elements of the live state; safe beside a running segment (``StepLoop``, which
        waits up to ``wait_s`` for a step boundary to read them at)."""
        return self.loop.memory_counts(wait_s)

    # ------------------------------------------------------------------ profiling

    def set_emulation(self, emulation: dict[str, Any] | None) -> dict[str, Any]:
        """Test and demo aid: emulate a slower device (``slowdown`` x compute time, a
        ``memory_gb`` budget for the planner, ``stands_for`` a display name). Returns info();
        the step loop re-installs the hooks (this may run mid-step)."""
        self.profiler.set_emulation(emulation)
        return self.info()

    def profile(self, batch: int, detail: bool = False) -> dict[str, Any]:
        """This worker's speed for the job's model (``Profiler.profile``), with ``as_info``:
        the emulation it was measured under, as ``info()`` says it (it may change mid-run)."""
        out = self._guard(self.profiler.profile, batch, detail)
        info = self.info()
        return {**out, "as_info": {k: info[k] for k in ("emulation", "emulated",
                                                          "device_name")}}

    def profile_terms(self, shares: list[int], rounds: int = 7) -> dict[str, Any]:
        """Collective: this rank's measurements for the planner's cost model, each repeated
        ``rounds`` times (``Profiler.profile_terms``: trial dp steps under ``shares``)."""
        def control() -> Any:  # started here, waited for a step later (as the step loop)
            return self.membership.ctrl_allreduce(torch.zeros(6, dtype=torch.float64))

        return self._guard(lambda: self.profiler.profile_terms(
            list(shares), self.membership.rank, self.membership.world, control, rounds))

    def shutdown(self) -> None:
        if getattr(self, "config", None) is None:  # a pooled worker between jobs
            return
        self.checkpoints.close()
        self.leave()
        if self.heartbeat is not None:
            self.heartbeat.stop()

    # ------------------------------------------------------------------ recovery

    def progress(self) -> dict[str, Any]:
        """Local: where this worker's state stands (no collective)."""
        strategy, spec = self.layout.strategy, self.layout.spec
        return {"next_step": self.layout.next_step,
                "has_state": strategy is not None or self.held.has_state(),
                "strategy": spec.name if spec else None,
                "pending_update": self.held.pending(strategy)}

    def finish_pending_step(self) -> int:
        """Local, after a failure: apply a step whose final all-reduce failed here after its
        gradients were complete (a peer applied it): ``HeldState.roll_forward``. Returns the
        next step."""
        if self.held.roll_forward(lambda: self.layout.strategy):
            self.layout.next_step += 1
        return self.layout.next_step

    def held_keys(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Local: canonical keys this rank holds in full, with shape and dtype."""
        return self.held.keys(self.layout.strategy)

    def snapshot_full(self) -> int:
        """Collective over the current (healthy) group: keep the full canonical state in
        memory, so that a planned membership change can hand every entry to the new group
        from any old rank. Returns the bytes held."""
        assert self.layout.strategy is not None
        return self._guard(self.held.snapshot_full, self.layout.strategy)

    def restore_from_peers(self, spec: StrategySpec, plan: PeerPlan,
                           next_step: int) -> dict[str, Any]:
        """Collective over the new group: every key is broadcast from the rank that holds it
        (``plan`` = [(key, source rank, shape, dtype)]), then the job is laid out as ``spec``.
        """
        def go() -> dict[str, Any]:
            t0 = time.perf_counter()
            state, nbytes = self.held.from_peers(plan, self.layout.strategy,
                                                 self.membership.rank, self.device)
            self.layout.restart(spec, state, next_step)
            copied = self.copies.restored(self.layout.strategy, next_step)
            return {"seconds": time.perf_counter() - t0, "bytes": nbytes, **copied}
        return self._guard(go)

    def restart_fresh(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None,
                      next_step: int) -> dict[str, Any]:
        """Drop any live state and lay out ``spec`` from ``state`` (a checkpoint's canonical
        state) or, if None, from the seeded initial model."""
        def go() -> dict[str, Any]:
            t0 = time.perf_counter()
            self.layout.restart(spec, state, next_step)
            copied = self.copies.restored(self.layout.strategy, next_step)
            return {"seconds": time.perf_counter() - t0, **copied}
        return self._guard(go)

    # ------------------------------------------------------------------ evacuation, copies

    def hand_off(self, leaving: list[int]) -> dict[str, Any]:
        """Collective over the current group, at a step boundary: the pieces of the state
        that only the ``leaving`` ranks hold go to survivors, checked, and are kept there
        with the state this rank parks at ``leave`` (``elastic.worker.handoff``)."""
        def go() -> dict[str, Any]:
            got, out = hand_off(self.held.pieces(self.layout.strategy), leaving, self.device)
            self.held.carried += got
            return out
        return self._guard(go)

    def restore_from_pieces(self, spec: StrategySpec, next_step: int) -> dict[str, Any]:
        """Collective over the new group: lay out ``spec`` from the pieces the ranks hold
        (parked at leave, and carried for a draining rank), each rank receiving only what it
        keeps; checked as a switch is (``StateMoveError``: nothing was loaded)."""
        def go() -> dict[str, Any]:
            out = self.layout.from_pieces(spec, self.held.pieces(None), next_step)
            return {**out, **self.copies.restored(self.layout.strategy, next_step)}
        return self._guard(go)

    def copies_status(self) -> dict[str, Any]:
        """Local: the steps at which this rank holds buddy copies and its own snapshot, and
        which pieces (``elastic.worker.peer_copies``)."""
        return self.copies.status()

    def restore_from_copies(self, spec: StrategySpec, step: int) -> dict[str, Any]:
        """Collective over the new group: lay out ``spec`` from the snapshots and buddy
        copies of ``step`` the ranks hold, every copy's checksum verified first on every
        rank (``StateMoveError`` on all of them when one does not match: nothing loaded)."""
        from ..errors import StateMoveError

        def go() -> dict[str, Any]:
            try:
                pieces, err = self.copies.restore_pieces(step), None
            except StateMoveError as e:
                pieces, err = [], e
            if not self.membership.all_ranks(err is None):
                raise err or StateMoveError("another rank's copy does not match its checksum")
            out = self.layout.from_pieces(spec, pieces, step)
            del pieces  # (the old generation's buffers: freed before the new one is taken)
            return {**out, **self.copies.restored(self.layout.strategy, step)}
        return self._guard(go)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_now(self) -> dict[str, Any]:
        """Collective: take a checkpoint of the state as it is (the step boundary the job
        stopped at); returns the checkpoint notice the step loop would report."""
        return self._guard(lambda: self.checkpoints.now(self.layout.next_step))

    def restore_checkpoint(self, spec: StrategySpec, step: int, store: Any = None) -> dict[str, Any]:
        """Lay out ``spec`` from committed checkpoint ``step`` of ``store`` (default: the
        job's), checksums verified. A ``CheckpointError`` reaches the controller as it is."""
        self.checkpoints.release_held("a restore")
        out = self._guard(self.checkpoints.restore, spec, step, store)
        return {**out, **self._guard(self.copies.restored, self.layout.strategy, step)}

    def checkpoint_poll(self) -> dict[str, Any] | None:
        """The upload's outcome: None while uploading or idle, else {"info": ShardInfo dict}
        or {"error": message} (the upload is then abandoned)."""
        return self.checkpoints.poll()

    def checkpoint_done(self, step: int, committed: bool, generation: int | None = None,
                        seq: int | None = None) -> None:
        self.checkpoints.done(step, committed, generation, seq)
