"""The worker: one Ray actor per device, one rank of the current process group.

The actor is threaded (``max_concurrency=2``): ``run`` executes the training loop while the
controller drains metrics and posts stop requests through the second thread. The controller
is not in the step path: a worker runs steps on its own and only agrees with its peers, in one
tiny all-reduce per step, on the global loss and on whether anyone was asked to stop.

Group lifecycle: ``join`` forms a group (a TCPStore rendezvous at the address the controller
names, a new port per generation); ``leave`` tears it down. The model, optimizer and data
position survive ``leave``/``join``, which is what lets survivors keep their memory when a
node is lost.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from strategies import (
    Runtime,
    Strategy,
    StrategySpec,
    check_layout,
    on_before_update,
    reshard,
    state_hash,
)
from strategies import get as get_strategy

from .config import JobConfig
from .data import StepSampler, even_shares, fetch_batch, share_bounds
from .errors import InfrastructureError, SwitchError, WorkerError
from .measure import SpanHooks, profile_terms
from .reference import build_model, build_model_for_load

__all__ = ["Worker", "is_infrastructure_error"]

_INFRA_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "gloo",
    "nccl",
    "timed out",
    "timeout",
    "socket",
    "store",
    "no route to host",
    "connection refused",
)


def is_infrastructure_error(exc: BaseException) -> bool:
    """True when ``exc`` comes from the group (a lost peer, a broken socket, a timeout)."""
    if isinstance(exc, (InfrastructureError, ConnectionError, TimeoutError)):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _INFRA_MARKERS)
    return False



def _compute_blocks(strategy: Any) -> list[torch.nn.Module]:
    """The modules whose forward is this rank's compute, finest first: the blocks of its
    pipeline stages, else the model's pipeline blocks, else the whole local model."""
    from strategies.pipeline import pipeline_blocks_or_none

    stages = getattr(strategy, "stages", None)
    if stages:
        return [b for st in stages for b in st.blocks]
    model = strategy.local_model()
    blocks = pipeline_blocks_or_none(model)
    return [b for _, b in blocks] if blocks else [model]


def _control_group(rank: int, world: int, generation: int, timeout_s: float) -> Any:
    """A gloo group of the same ranks for the per-step control all-reduce, kept out of
    torch's group registry. That all-reduce runs asynchronously behind the next step; if a
    peer dies, it can stay blocked on a *live* peer until the group timeout, and tearing down
    a registered group (``destroy_process_group`` shuts every group down) waits for its
    in-flight work: two survivors leaving would each wait out the timeout (measured: 30 s of
    a pipeline recovery). ``leave`` hands this group to a thread that lets it end instead.
    None if it cannot be made (then the control all-reduce is synchronous)."""
    try:
        from torch._C._distributed_c10d import ProcessGroupGloo

        store = dist.PrefixStore(f"elastic-ctrl/{generation}",
                                 dist.distributed_c10d._get_default_store())
        return ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a torch without these internals: synchronous control
        return None


def _all_ranks(ok: bool, device: torch.device) -> bool:
    """Collective over the default group: True on every rank iff ``ok`` on every rank."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0


def _retire(pg: Any, work: Any) -> None:
    """Let a control group's last operation end (at once, or at its timeout after a
    failure), then drop it: its destructor joins its threads, so not on a caller's thread."""
    try:
        if work is not None:
            work.wait()
    except Exception:  # noqa: BLE001 - a failed peer: the error is expected
        pass
    del pg, work


class _Done:
    """A finished operation (the synchronous fallback of the control all-reduce)."""

    def wait(self) -> bool:
        return True


@dataclasses.dataclass
class _Pending:
    """A finished step whose control all-reduce is in flight."""

    step: int
    work: Any
    ctrl: torch.Tensor
    t0: float
    t_end: float
    wall_end: float
    lo: int
    hi: int
    lr: float | None = None  # the lr of the step's update (with an lr_schedule)
    grad_norm: float | None = None  # the global gradient norm before clipping (max_grad_norm)
    eval_loss: float | None = None  # the mean loss over eval_dataset after this step
    compute_s: float = 0.0  # seconds inside this rank's blocks' forwards (its own compute)


class Worker:
    """Body of the worker actor (wrapped with ``ray.remote`` by the controller)."""

    def __init__(self, config: JobConfig, worker_id: int, use_gpu: bool, num_threads: int) -> None:
        self.config = config
        self.worker_id = worker_id
        self.use_gpu = use_gpu
        torch.set_num_threads(max(1, num_threads))
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(self.device)
            if config.precision == "bf16" and not torch.cuda.is_bf16_supported():
                raise ValueError(
                    f"precision: bf16 is not supported by {torch.cuda.get_device_name()} "
                    "(bf16 needs compute capability 8.0+: A100, H100, L4...); fix: use "
                    "precision: fp32 for this cluster, or place the job on bf16 devices")
        self.backend = "nccl" if use_gpu else "gloo"
        self.rank = -1
        self.world = 0
        self.generation = 0
        self.strategy: Any = None
        self.spec: StrategySpec | None = None
        self._model_factory = config.model_factory()
        self._lr_fn = config.lr_schedule_fn()
        # optimizers the strategies built, with their factory-set lr per param group (the
        # schedule multiplies those); weak: a strategy that closes drops its optimizer
        self._base_lrs: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
        self._optimizer_factory = self._scheduled_factory(config.optimizer_factory())
        self._loss_fn = config.loss_fn()
        self._dataset: Any = None
        self._eval_ds: Any = None  # eval_dataset, read on the first evaluation
        self._sampler: StepSampler | None = None
        self._metrics: deque[dict[str, Any]] = deque()
        self._stop = threading.Event()
        self._emulated_slowdown = 1.0
        self._emulation: dict[str, Any] = {}
        self._spans = SpanHooks()  # per-block timing and the emulated slowdown's sleeps
        self._slow_dirty = False
        self._param_keys: set[str] = set()  # "model/<fqn>" of parameters (not buffers)
        self._unhook_update: Callable[[], None] | None = None
        self._staged_wait_s = 0.0  # waits for a checkpoint's deferred copy, not yet reported
        self._ctrl_pg: Any = None  # the control all-reduce's own gloo group (_control_group)
        self._ctrl_work: Any = None  # its last operation
        self.next_step = 0  # data position: the first step not yet applied to this state
        self._snapshot: dict[str, torch.Tensor] | None = None  # full (planned change) or
        # held (parked at leave) canonical state, kept until the next layout
        self._rolled: dict[str, torch.Tensor] | None = None  # parked state one step on (leave)
        self._leave_lock = threading.Lock()
        self._store: Any = None  # CheckpointStore when checkpoints are on
        self._writer: Any = None  # ShardWriter for (store, rank)
        self._writer_rank = -1
        if config.checkpoint_every > 0 or config.checkpoint_uri:
            from .checkpoint_io import job_store

            self._store = job_store(config)
        gc.freeze()  # start-up objects (torch, ray, the job's modules) skip later collections,
        # which keeps the one in leave() short

    def _scheduled_factory(self, factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The job's optimizer factory, recording each optimizer's base lrs when the job has
        an ``lr_schedule`` (``_set_lr`` applies it before every step)."""
        if self._lr_fn is None:
            return factory
        base_lrs = self._base_lrs

        def build(params: Any) -> Any:
            opt = factory(params)
            base_lrs[opt] = [g["lr"] for g in opt.param_groups]
            return opt
        return build

    def _set_lr(self, step: int) -> float | None:
        """Set every live optimizer's lr for the update of ``step``: base lr x schedule(step),
        from the step alone, so a switch, a recovery or a resume continues the schedule.
        Returns the first param group's lr (None without a schedule)."""
        if self._lr_fn is None:
            return None
        mult = float(self._lr_fn(step))
        lr = None
        for opt, bases in list(self._base_lrs.items()):
            for group, base in zip(opt.param_groups, bases, strict=True):
                group["lr"] = base * mult
            lr = float(bases[0]) * mult if lr is None else lr
        return lr  # None on a rank with no optimizer (a ZeRO rank that owns nothing)

    # ------------------------------------------------------------------ identity and group

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        dev = self.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        return {
            "worker_id": self.worker_id,
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(dev),
            "device_name": name,
            "threads": torch.get_num_threads(),
            "emulation": dict(self._emulation),
            "emulated": bool(self._emulation),
        } | ({"device_name": f"{self._emulation.get('stands_for') or name} (emulated on {name}, "
                              f"x{self._emulated_slowdown:g})"} if self._emulation else {})

    def free_port(self) -> int:
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return int(s.getsockname()[1])

    def join(self, addr: str, port: int, rank: int, world: int, generation: int,
             timeout_s: float) -> float:
        """Form generation ``generation`` of the group; returns seconds taken."""
        t0 = time.perf_counter()
        self.leave()
        dist.init_process_group(
            self.backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        self._ctrl_pg = _control_group(rank, world, generation, timeout_s)
        self.rank, self.world, self.generation = rank, world, generation
        return time.perf_counter() - t0

    def leave(self) -> None:
        """Tear down the current group, if any. The state this rank holds stays in memory,
        parked as canonical CPU tensors, and the strategy is dropped with every reference it
        had to the group (sub-groups, the DDP reducer, FSDP meshes): a gloo group closes its
        sockets only when its last reference goes, and only then do peers blocked on this
        rank fail at once instead of at the group timeout. Every path after a leave lays the
        job out again from parked, peer or checkpoint state."""
        with self._leave_lock:
            dropped = self.strategy is not None
            if dropped:
                if self._snapshot is None:
                    self._snapshot = self._held()
                    if getattr(self.strategy, "pending_update", False):
                        # the step's final all-reduce failed here after the gradients were
                        # complete: keep the state after the update too, so that a roll-forward
                        # (finish_pending_step) still works once the strategy is gone
                        if self.strategy.finish_pending_step():
                            self._rolled = self._held_live()
                self._drop_strategy()
            pg, work = self._ctrl_pg, self._ctrl_work
            self._ctrl_pg = self._ctrl_work = None
            if pg is not None:  # see _control_group: never joined here
                threading.Thread(target=_retire, args=(pg, work), daemon=True,
                                 name="elastic-retire-ctrl").start()
                del pg, work
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # a group whose peers died may fail to close cleanly
                    pass
            if dropped:  # reference cycles (hooks, schedules) hold groups too
                gc.collect()

    def _drop_strategy(self) -> None:
        if self.strategy is not None:
            self.strategy.close()
            self.strategy = None

    # ------------------------------------------------------------------ layout

    def _runtime(self) -> Runtime:
        return Runtime(self.rank, self.world, self.device)

    def _ensure_data(self) -> None:
        if self._dataset is None:
            self._dataset = self.config.dataset_object()
            self._sampler = StepSampler(len(self._dataset), self.config.global_batch_size,
                                        self.config.seed)

    def build(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Lay the job out as ``spec``: from the live state when a strategy already runs
        (an in-memory switch), else from a fresh seeded model, then ``state`` if given."""
        return self._guard(self._build, spec, state)

    def _build(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        if state is not None or self.strategy is None:
            self._build_fresh(spec, state)
            return {"seconds": time.perf_counter() - t0, "hash_before": None, "hash_after": None}
        mode = self.config.switch_check
        if self.config.switch_move == "reshard" and mode != "rehash":
            return self._reshard_to(spec, t0)
        # live switch through a gather: the full canonical state on every rank, then the new
        # layout keeps its part
        old_spec = self.spec
        state = self.strategy.full_state()
        before = state_hash(state)
        self.strategy.close()
        self.strategy = None
        try:
            self._build_fresh(spec, state)
        except Exception:
            # a failed switch leaves the job in its old layout, with the same state
            assert old_spec is not None
            self._build_fresh(old_spec, state)
            raise
        # the proof that nothing changed (docs/architecture.md, Switches)
        problems: list[str] = []
        if mode == "rehash":  # a second gather and hash of the whole state
            after = state_hash(self.strategy.full_state())
        elif mode == "pieces":  # each rank's pieces bit-equal to the hashed state, no gather
            problems = check_layout(self.strategy, state)
            after = before if not problems else f"differs: {problems[0]}"
        else:
            after = before
        if after != before:  # keep the job on its old layout, from the state hashed before
            assert old_spec is not None
            self._build_fresh(old_spec, state)
        return {"seconds": time.perf_counter() - t0, "hash_before": before, "hash_after": after,
                "verified": mode != "off", "check": mode, "problems": problems[:10]}

    def _reshard_to(self, spec: StrategySpec, t0: float) -> dict[str, Any]:
        """Live switch by moving pieces (``strategies.reshard``): the new layout is built
        beside the old one, each rank receives only what its new layout keeps, and the old
        layout is dropped only once every piece has been checked; if anything fails the job
        stays on the old layout, untouched."""
        assert self.strategy is not None
        old = self.strategy
        try:
            new: Strategy | None = self._new_strategy(spec, for_load=True)
            built = None
        except Exception as e:  # said to every rank below: none may wait in the move for it
            new, built = None, e
        if not _all_ranks(built is None, self.device):
            if new is not None:
                new.close()
            if built is not None:
                raise built
            raise SwitchError(f"another rank could not build {spec.name}; the job stays on "
                              f"{self.spec.name if self.spec else 'its old layout'}")
        assert new is not None
        try:
            res = reshard(old, new, check=self.config.switch_check != "off")
        except BaseException:
            new.close()
            raise
        if res.problems:  # the old layout still runs, unchanged
            new.close()
            after = f"differs: {res.problems[0]}"
        else:
            old.close()
            self.strategy, self.spec = new, spec
            self._install_slowdown()
            after = res.hash_after
        return {"seconds": time.perf_counter() - t0, "hash_before": res.hash_before,
                "hash_after": after, "verified": self.config.switch_check != "off",
                "check": self.config.switch_check, "move": "reshard",
                "problems": res.problems[:10], "bytes_sent": res.bytes_sent,
                "bytes_kept": res.bytes_kept}

    # ------------------------------------------------------------------ training loop

    def run(self, start: int, end: int) -> dict[str, Any]:
        """Train steps ``start..end-1``; stop early at a step boundary if any rank was asked.

        Returns ``{"status": "done"|"stopped", "next_step": n}``. Raises ``WorkerError`` for
        user-code failures and ``InfrastructureError`` for group failures.
        """
        return self._guard(self._run, start, end)

    def _run(self, start: int, end: int) -> dict[str, Any]:
        """The step loop. After each step the ranks agree on its loss, samples, stop flag
        and checkpoint state with one small all-reduce, issued asynchronously and waited for
        after the *next* step's compute (a synchronous one cost ~5 % of a 30 ms step on 2
        cores: one more rendezvous per step). All ranks read the same values at the same
        point, so they still stop at the same step (one step after the ask). A step that
        ends a checkpoint interval or the segment waits for its own values at once."""
        assert self.strategy is not None and self.spec is not None and self._sampler is not None
        self._stop.clear()
        lo, hi = share_bounds(self.spec.shares, self.rank)
        pending: _Pending | None = None
        step = start
        while step < end:
            t0 = time.perf_counter()
            if self._slow_dirty:
                self._install_slowdown()
            idx = self._sampler.indices(step)[lo:hi]
            x, y = fetch_batch(self._dataset, idx)
            lr = self._set_lr(step)
            self._spans.take()
            local = self.strategy.train_step(x, y)
            compute_s = self._spans.take()
            norm = self.strategy.last_grad_norm
            self.next_step = step + 1
            busy = 1.0 if self._writer is not None and self._writer.state != "idle" else 0.0
            ctrl = torch.tensor([local, 1.0 if self._stop.is_set() else 0.0, float(hi - lo), busy],
                                dtype=torch.float64)
            work = self._ctrl_allreduce(ctrl)
            stop = False
            if pending is not None:  # the previous step's values, reduced meanwhile
                stop = self._finish_step(pending)
            pending = _Pending(step, work, ctrl, t0, time.perf_counter(), time.time(), lo, hi,
                               lr, norm, compute_s=compute_s)
            if self._eval_due(step):  # between steps: its time counts in neither
                pending.eval_loss = self._evaluate()
            if self._checkpoint_due(step) or step + 1 == end or stop:
                stop = self._finish_step(pending) or stop
                pending = None
            step += 1
            if stop and step < end:
                return {"status": "stopped", "next_step": step}
        return {"status": "done", "next_step": step}

    def _eval_due(self, step: int) -> bool:
        """Whether the model is evaluated after ``step`` (every N steps, and after the last)."""
        if self.config.eval_dataset is None:
            return False
        every = self.config.eval_every
        return (every > 0 and (step + 1) % every == 0) or step + 1 == self.config.max_steps

    def _evaluate(self) -> float:
        """Collective: the mean loss over the whole eval dataset, in order, in batches of
        ``eval_batch_size`` split evenly across the ranks (every rank takes part in every
        batch, with an empty part if it must: a zero3 forward is a collective). A pipeline's
        stages have training shapes, so it scores batches of G split like training, and
        a last partial batch is padded with its last sample, whose loss a batch of only that
        sample then takes back out (exact when a sample's loss does not depend on the rest
        of its batch, as in eval mode without batch statistics)."""
        assert self.strategy is not None and self.spec is not None
        if self._eval_ds is None:
            self._eval_ds = self.config.eval_dataset_object()
        ds, spec = self._eval_ds, self.spec
        n = len(ds)
        pipeline = spec.name == "pipeline"
        e = spec.global_batch_size if pipeline else (
            self.config.eval_batch_size or self.config.global_batch_size)
        total = torch.zeros(2, dtype=torch.float64)
        for start in range(0, n, e):
            idx = torch.arange(start, min(start + e, n))
            if not pipeline:
                total += self._eval_part(ds, idx, even_shares(len(idx), self.world))
                continue
            pad = e - len(idx)
            if pad:
                last = idx[-1:]
                total += self._eval_part(ds, torch.cat([idx, last.repeat(pad)]), spec.shares)
                total -= self._eval_part(ds, last.repeat(e), spec.shares) * (pad / e)
            else:
                total += self._eval_part(ds, idx, spec.shares)
        total = total.to(self.device)
        dist.all_reduce(total)
        return float(total[0] / total[1])

    def _eval_part(self, ds: Any, idx: torch.Tensor, shares: Sequence[int]) -> torch.Tensor:
        """This rank's ``(loss x samples, samples)`` of one evaluation batch."""
        lo, hi = share_bounds(shares, self.rank)
        if hi > lo:
            x, y = fetch_batch(ds, idx[lo:hi])
        else:  # an empty part with the right trailing shapes
            x, y = fetch_batch(ds, idx[:1])
            x, y = x[:0], y[:0]
        return torch.tensor(self.strategy.eval_step(x, y), dtype=torch.float64)

    def _checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is taken after ``step`` (every K steps, and after the last)."""
        every = self.config.checkpoint_every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.config.max_steps)

    def _ctrl_allreduce(self, ctrl: torch.Tensor) -> Any:
        """Start the control all-reduce on the control group (CPU, gloo); returns a waitable."""
        if self._ctrl_pg is None:  # no separate group (see _control_group): synchronous
            dist.all_reduce(ctrl)
            return _Done()
        work = self._ctrl_pg.allreduce([ctrl])
        self._ctrl_work = work
        return work

    def _finish_step(self, p: _Pending) -> bool:
        """Wait for step ``p.step``'s agreed values; record its metrics and take (or skip) a
        checkpoint due after it. Returns whether any rank asked to stop."""
        p.work.wait()
        p.work = None
        loss, stop, trained, busy = p.ctrl.tolist()
        step = p.step
        ckpt: dict[str, Any] = {}
        if self._checkpoint_due(step):
            if busy > 0 and not self._wait_writer_idle():
                # the previous checkpoint is still not committed: all ranks skip this one
                ckpt = {"checkpoint_skipped": step + 1}
            else:
                ckpt = {"checkpoint_begun": step + 1,
                        "checkpoint_blocked_s": self._checkpoint_begin(step + 1)}
        if self._staged_wait_s > 0:  # an earlier checkpoint's copy held this step's update
            ckpt["checkpoint_wait_s"] = self._staged_wait_s
            self._staged_wait_s = 0.0
        dt = p.t_end - p.t0
        self._metrics.append({
            "step": step, "rank": self.rank, "loss": loss, "step_time": dt,
            "samples": p.hi - p.lo, "range": [p.lo, p.hi],
            "samples_per_s": self.config.global_batch_size / dt if dt > 0 else 0.0,
            "time": p.wall_end, "generation": self.generation,
            "global_samples": int(trained), "compute_s": p.compute_s, **ckpt,
            **({"lr": p.lr} if p.lr is not None else {}),
            **({"grad_norm": p.grad_norm} if p.grad_norm is not None else {}),
            **({"eval_loss": p.eval_loss} if p.eval_loss is not None else {}),
        })
        return stop > 0

    # ------------------------------------------------------------------ recovery

    def progress(self) -> dict[str, Any]:
        """Local: where this worker's state stands (no collective)."""
        pending = (self._rolled is not None if self.strategy is None
                   else bool(getattr(self.strategy, "pending_update", False)))
        return {"next_step": self.next_step,
                "has_state": self.strategy is not None or self._snapshot is not None,
                "strategy": self.spec.name if self.spec else None,
                "pending_update": pending}

    def finish_pending_step(self) -> int:
        """Local, after a failure: apply a step whose gradients were complete when its final
        all-reduce failed here (the caller knows a peer applied it), on the live strategy or,
        after ``leave``, by taking the parked state with that update applied. Returns the
        next step."""
        with self._leave_lock:
            if self.strategy is None:
                if self._rolled is not None:
                    self._snapshot, self._rolled = self._rolled, None
                    self.next_step += 1
            elif getattr(self.strategy, "finish_pending_step", lambda: False)():
                self.next_step += 1
        return self.next_step

    def held_keys(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Local: canonical keys this rank holds in full, with shape and dtype."""
        held = self._held()
        return {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in held.items()}

    def _held(self) -> dict[str, torch.Tensor]:
        if self._snapshot is not None:
            return self._snapshot
        return self._held_live()

    def _held_live(self) -> dict[str, torch.Tensor]:
        fn = getattr(self.strategy, "held_state", None)
        return fn() if fn is not None else {}

    def snapshot_full(self) -> int:
        """Collective over the current (healthy) group: keep the full canonical state in
        memory, so that a planned membership change can hand every entry to the new group
        from any old rank. Returns the bytes held."""
        def go() -> int:
            assert self.strategy is not None
            self._snapshot = self.strategy.full_state()
            return sum(t.numel() * t.element_size() for t in self._snapshot.values())
        return self._guard(go)

    def restore_from_peers(self, spec: StrategySpec, plan: list[tuple[str, int, tuple[int, ...], str]],
                           next_step: int) -> dict[str, Any]:
        """Collective over the new group: every key is broadcast from the rank that holds it
        (``plan`` = [(key, source rank, shape, dtype)]), then the job is laid out as ``spec``.
        """
        return self._guard(self._restore_from_peers, spec, plan, next_step)

    def _restore_from_peers(self, spec: StrategySpec, plan: list[tuple[str, int, tuple[int, ...], str]],
                            next_step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        held = self._held()
        state: dict[str, torch.Tensor] = {}
        nbytes = 0
        comm_dev = self.device  # NCCL needs device tensors; gloo takes CPU tensors
        for key, src, shape, dtype in plan:
            if self.rank == src:
                t = held[key].to(comm_dev).contiguous()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=comm_dev)
            dist.broadcast(t, src=src)
            state[key] = t.cpu()
            nbytes += t.numel() * t.element_size()
        self._build_fresh(spec, state)
        self.next_step = next_step
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes}

    def restart_fresh(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None,
                      next_step: int) -> dict[str, Any]:
        """Drop any live state and lay out ``spec`` from ``state`` (a checkpoint's canonical
        state) or, if None, from the seeded initial model."""
        def go() -> dict[str, Any]:
            t0 = time.perf_counter()
            self._build_fresh(spec, state)
            self.next_step = next_step
            return {"seconds": time.perf_counter() - t0}
        return self._guard(go)

    def _build_fresh(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None,
                     read: Callable[[Strategy], dict[str, torch.Tensor]] | None = None) -> None:
        """Lay out ``spec`` from ``state`` (the full canonical state), from ``read(strategy)``
        (only what the built layout ``needs``: a checkpoint restore), else from the seeded
        model, replacing any live or parked state."""
        self._drop_strategy()
        self._snapshot = self._rolled = None
        strat = self._new_strategy(spec, for_load=state is not None or read is not None)
        try:
            if state is not None:
                strat.load_full_state(state)
            elif read is not None:
                strat.load_state(read(strat))
        except BaseException:
            strat.close()
            raise
        self.strategy, self.spec = strat, spec
        self._install_slowdown()

    def _new_strategy(self, spec: StrategySpec, for_load: bool) -> Strategy:
        """A new layout ``spec`` of a fresh model: seeded, or (``for_load``: every entry is
        overwritten next) built without initializing and with no init broadcast."""
        self._ensure_data()
        cls = get_strategy(spec.name)
        if for_load:
            model = build_model_for_load(self._model_factory, self.config.seed)
        else:
            model = build_model(self._model_factory, self.config.seed)
        self._param_keys = {f"model/{n}" for n, _ in model.named_parameters()}
        # the job's settings every layout applies (the controller's specs carry them already)
        opts = {**self.config.strategy_options(), **spec.options}
        if for_load:
            opts["init_sync"] = False
        spec = dataclasses.replace(spec, options=opts)
        cls.validate(spec, model)
        return cls(spec, self._runtime(), model, self._optimizer_factory, self._loss_fn)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_begin(self, step: int) -> float:
        """Collective at a step boundary: decide which rank writes what, copy it to host
        memory and start the background upload. Returns the seconds training was blocked."""
        from .checkpoint_io import checkpoint_pieces

        t0 = time.perf_counter()
        writer = self._ensure_writer()
        pieces = checkpoint_pieces(self.strategy, self.rank, self.world)
        if self._unhook_update is None:
            self._unhook_update = on_before_update(self._before_update)
        params = self._param_keys
        # parameters and optimizer state change only in a step's update: their host copy runs
        # beside the next step's forward and backward, and the update waits for it; buffers
        # (changed by forward) and everything else are copied now
        writer.begin(step, pieces, later=lambda k: k.startswith("optim/") or k in params)
        return time.perf_counter() - t0

    def _before_update(self) -> None:
        """Runs before any strategy changes parameters or optimizer state: the deferred host
        copy of a checkpoint must be done by then (time waited counts as blocked)."""
        if self._writer is not None:
            self._staged_wait_s += self._writer.staged()

    def _wait_writer_idle(self) -> bool:
        """Collective: wait (bounded by ``checkpoint_wait_s``) until this rank's previous
        checkpoint is committed or abandoned; True on every rank iff all are ready."""
        deadline = time.monotonic() + self.config.checkpoint_wait_s
        while self._writer is not None and self._writer.state != "idle":
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return _all_ranks(self._writer is None or self._writer.state == "idle", self.device)

    def _ensure_writer(self) -> Any:
        from .checkpoint import ShardWriter

        if self._writer is None or self._writer_rank != self.rank:
            if self._writer is not None:
                self._writer.abandon()
                self._writer.close()
            self._writer = ShardWriter(self._store, self.rank)
            self._writer_rank = self.rank
        return self._writer

    def checkpoint_poll(self) -> dict[str, Any] | None:
        """The upload's outcome: None while uploading or idle, else {"info": ShardInfo dict}
        or {"error": message} (the upload is then abandoned)."""
        w = self._writer
        if w is None or w.state in ("idle", "uploading"):
            return None
        try:
            info = w.poll()
        except Exception as e:  # a failed upload: report it, training goes on
            return {"error": str(e), "step": w.step}
        return {"info": info.to_dict()} if info is not None else None

    def checkpoint_done(self, step: int, committed: bool) -> None:
        if self._writer is None:
            return
        if committed:
            self._writer.committed(step)
        else:
            self._writer.abandon()

    def restore_checkpoint(self, spec: StrategySpec, step: int, store: Any = None) -> dict[str, Any]:
        """Lay out ``spec`` from committed checkpoint ``step`` of ``store`` (default: the
        job's), checksums verified."""
        def go() -> dict[str, Any]:
            from .checkpoint import CheckpointReader

            t0 = time.perf_counter()
            out: dict[str, Any] = {}
            with CheckpointReader(store or self._store, step) as reader:
                metas = reader.tensors()
                rng_key = f"rng/rank{self.rank}/torch"

                def read(strat: Any) -> dict[str, torch.Tensor]:
                    # only what the new layout keeps on this rank (its shard, its stages)
                    want: dict[str, tuple[int, int] | None] = {}
                    for key, m in metas.items():
                        if key.startswith("rng/"):
                            continue
                        need = strat.needs(key, m.full_shape)
                        if need is True:
                            want[key] = None
                        elif need:
                            want[key] = (int(need[0]), int(need[1]))
                    if rng_key in metas:
                        want[rng_key] = None
                    state = reader.read(want)
                    out["rng"] = state.pop(rng_key, None)
                    out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
                    out["total_bytes"] = sum(
                        m.dtype.itemsize * math.prod(m.full_shape)
                        for k, m in metas.items() if not k.startswith("rng/"))
                    return state

                self._build_fresh(spec, None, read=read)
            if out["rng"] is not None:
                torch.set_rng_state(out["rng"])
            self.next_step = step
            return {"seconds": time.perf_counter() - t0, "bytes": out["bytes"],
                    "total_bytes": out["total_bytes"]}
        return self._guard(go)

    def request_stop(self) -> None:
        """Ask the loop to stop after the current step (all ranks agree on the same step)."""
        self._stop.set()

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while self._metrics:
            out.append(self._metrics.popleft())
        return out

    # ------------------------------------------------------------------ state

    def full_state(self, want: bool = True) -> dict[str, torch.Tensor] | None:
        """Collective: every rank must call. Returns the canonical state if ``want``."""
        assert self.strategy is not None
        st = self._guard(self.strategy.full_state)
        return st if want else None

    def state_hash(self) -> str:
        assert self.strategy is not None
        return state_hash(self._guard(self.strategy.full_state))

    def memory_counts(self) -> dict[str, int]:
        assert self.strategy is not None
        return self.strategy.memory_counts()

    def set_emulation(self, emulation: dict[str, Any] | None) -> dict[str, Any]:
        """Test and demo aid: emulate a slower device (``slowdown`` x compute time, a
        ``memory_gb`` budget for the planner, ``stands_for`` a display name). Returns info()."""
        self._emulation = dict(emulation or {})
        self._emulated_slowdown = max(1.0, float(self._emulation.get("slowdown", 1.0)))
        self._slow_dirty = True  # the step loop re-installs the hooks (this may run mid-step)
        return self.info()

    def _install_slowdown(self) -> None:
        """Hooks on every block this rank runs (each pipeline stage's blocks, else the model's
        blocks, else the whole model): they time the blocks' forwards (this rank's own
        compute, reported per step as ``compute_s``) and, on an emulated slower device, sleep
        ``(slowdown - 1) x`` each block's forward time right after its forward and ``(slowdown
        - 1) x`` its backward time right after its backward. So each phase is slow where it
        happens: a slow pipeline stage on every micro-batch, a slow zero3 rank in each
        block's forward *and* backward (whose gathers and reduce-scatters synchronize the
        ranks block by block), and collectives between blocks are not slowed
        (``elastic.measure.SpanHooks``)."""
        self._slow_dirty = False
        if self.strategy is None:
            self._spans.remove()
            return
        self._spans.install(_compute_blocks(self.strategy), self._emulated_slowdown,
                            self.device)

    def _autocast(self) -> Any:
        """The job's compute precision for the profiler's private forward passes."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.config.precision == "bf16")

    def _profile_base(self, batch: int, min_s: float = 0.05, max_iters: int = 50) -> float:
        """Seconds per sample of forward+backward of a private copy of the model (no
        collective), before any emulated slowdown: the median of at least 5 timed iterations
        and at least ``min_s`` seconds of them (tiny models are noisy on a busy host)."""
        self._ensure_data()
        assert self._sampler is not None
        model = build_model(self._model_factory, self.config.seed).to(self.device)
        idx = self._sampler.indices(0)[:batch]
        x, y = fetch_batch(self._dataset, idx)
        x, y = x.to(self.device), y.to(self.device)
        times: list[float] = []
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for i in range(max_iters + 1):
            t0 = time.perf_counter()
            with self._autocast():
                loss = self._loss_fn(model(x), y)
            loss.backward()
            sync()
            if i:  # the first iteration warms up
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            if len(times) >= 5 and sum(times) >= min_s:
                break
        return sorted(times)[len(times) // 2] / batch

    def profile(self, batch: int, detail: bool = False) -> dict[str, Any]:
        """Measure this worker's speed for the job's model: samples/s of forward+backward,
        including its emulated slowdown (an emulated device reports what it emulates). With
        ``detail``: per-block forward+backward seconds per sample and the activation bytes
        per sample each block hands on (what a pipeline split needs)."""
        base = self._guard(self._profile_base, batch)
        out: dict[str, Any] = {"samples_per_s": 1.0 / (base * self._emulated_slowdown),
                               "base_s_per_sample": base}
        if detail:
            out.update(self._guard(self._profile_blocks, batch))
        return out

    def _profile_blocks(self, batch: int, iters: int = 3) -> dict[str, Any]:
        from .planning import blocks_of

        assert self._sampler is not None
        model = build_model(self._model_factory, self.config.seed).to(self.device)
        x, _ = fetch_batch(self._dataset, self._sampler.indices(0)[:batch])
        h = x.to(self.device)
        secs, bounds = [], []
        for block in blocks_of(model):
            inp = h.detach().requires_grad_(h.is_floating_point())
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                with self._autocast():
                    out = block(inp)
                out.backward(torch.ones_like(out))
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                block.zero_grad(set_to_none=True)
            secs.append(sorted(times)[iters // 2] / batch * self._emulated_slowdown)
            bounds.append(out.numel() * out.element_size() / batch)
            h = out.detach()
        return {"block_seconds": secs, "boundary_bytes": bounds}

    def measure_collectives(self, sizes: list[int], repeats: int = 3) -> list[tuple[int, float]]:
        """Collective: time all-reduces of ``sizes`` bytes in the current group (median)."""
        def go() -> list[tuple[int, float]]:
            out = []
            for n in sizes:
                t = torch.zeros(max(1, n // 4), dtype=torch.float32, device=self.device)
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                out.append((n, sorted(times)[repeats // 2]))
            return out
        return self._guard(go)

    def profile_terms(self, shares: list[int], rounds: int = 7) -> dict[str, Any]:
        """Collective: this rank's measurements for the planner's cost model, each repeated
        ``rounds`` times (``elastic.measure.profile_terms``; trial dp steps under ``shares``)."""
        from .planning import blocks_of

        def go() -> dict[str, Any]:
            self._ensure_data()
            assert self._sampler is not None
            lo, hi = share_bounds(shares, self.rank)
            sampler, data = self._sampler, self._dataset

            def batch(step: int) -> Any:
                return fetch_batch(data, sampler.indices(step)[lo:hi])

            def control() -> None:
                dist.all_reduce(torch.zeros(4, dtype=torch.float64, device=self.device))

            return profile_terms(
                model_factory=lambda: build_model(self._model_factory, self.config.seed),
                loss_fn=self._loss_fn, optimizer_factory=self.config.optimizer_factory(),
                batch=batch, shares=shares, rank=self.rank, world=self.world,
                device=self.device, autocast=self._autocast, slowdown=self._emulated_slowdown,
                rounds=rounds, control=control, blocks_of=blocks_of)
        return self._guard(go)

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.leave()

    # ------------------------------------------------------------------ errors

    def _guard(self, fn: Any, *args: Any) -> Any:
        """Run ``fn``; turn a failure into ``InfrastructureError`` (the group broke) or
        ``WorkerError`` (user code failed). The failed call's frames are cleared and the new
        error is raised outside the handler (no ``__context__``): a frame of a failed
        collective holds its gloo work and with it the group's sockets, so peers blocked on
        this rank would otherwise wait out the group timeout even after ``leave()``."""
        try:
            return fn(*args)
        except (WorkerError, InfrastructureError, SwitchError):
            raise
        except Exception as e:
            if is_infrastructure_error(e):
                err: Exception = InfrastructureError(
                    f"rank {self.rank}: the process group failed ({type(e).__name__}: {e})")
            else:
                err = WorkerError(self.rank, socket.gethostname(), f"{type(e).__name__}: {e}",
                                  traceback.format_exc())
            traceback.clear_frames(e.__traceback__)
        raise err
