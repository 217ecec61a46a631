"""Checkpointing on a worker: which rank writes what, the background writer, restores.

Every rank writes a shard of what it holds; replicated entries are written once, by one of the
ranks that hold them (balanced by bytes); sharded entries (zero3) are written as each rank's
rows, with no gather. A checkpoint is begun at a step boundary (``after_step``): buffers and
small entries are copied to host memory at once, parameters and optimizer state while the
next step computes (its update waits for that copy), then uploaded in the background. The
controller polls the upload and commits the manifest (docs/architecture.md, Checkpoints).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from strategies import StrategySpec, on_before_update

from ..checkpoint import CheckpointReader, CheckpointStore, Piece, ShardWriter
from ..checkpoint_io import job_store
from ..config import JobConfig, WorkerConfig
from ..errors import CheckpointError
from .layout import Layout
from .membership import Membership

CLOSE_WAIT_S = 5.0  # at the end of a job, an upload in flight stops at its next write: one
# that has not stopped by then is stuck in a storage call

__all__ = ["Checkpointing", "assign_writers", "checkpoint_pieces", "forget_groups", "rng_keys",
           "rng_states", "set_rng_states"]

log = logging.getLogger("elastic.worker")


def assign_writers(holdings: list[dict[str, int]]) -> dict[str, int]:
    """key -> the rank that writes it: among the ranks holding a key, the least loaded so far
    (largest keys first; ties to the lowest rank). Same answer on every rank."""
    sizes: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    for r, held in enumerate(holdings):
        for k, n in held.items():
            sizes[k] = n
            holders.setdefault(k, []).append(r)
    load = [0] * len(holdings)
    owner: dict[str, int] = {}
    for k in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(holders[k], key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += sizes[k]
    return owner


def _on_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def rng_keys(rank: int, device: torch.device | None = None) -> list[str]:
    """The keys a checkpoint keeps this rank's random generators under: the CPU one, and on
    a CUDA device that device's (dropout on the GPU draws from it)."""
    return [f"rng/rank{rank}/torch"] + ([f"rng/rank{rank}/cuda"] if _on_cuda(device) else [])


def rng_states(rank: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This rank's random generators now, under ``rng_keys``."""
    states = [torch.get_rng_state()]
    if device is not None and _on_cuda(device):
        states.append(torch.cuda.get_rng_state(device))
    return dict(zip(rng_keys(rank, device), states, strict=True))


def set_rng_states(states: dict[str, torch.Tensor], rank: int,
                   device: torch.device | None = None) -> None:
    """Set the generators ``rng_states`` saved for ``rank`` (those there are: a checkpoint
    written on CPU workers has no CUDA one, and a CPU worker ignores a CUDA one)."""
    cpu = states.get(f"rng/rank{rank}/torch")
    if cpu is not None:
        torch.set_rng_state(cpu)
    cuda = states.get(f"rng/rank{rank}/cuda")
    if cuda is not None and device is not None and _on_cuda(device):
        torch.cuda.set_rng_state(cuda, device)


def checkpoint_pieces(strategy: Any, rank: int, world: int,
                      device: torch.device | None = None) -> list[Piece]:
    """Collective. The pieces this rank writes for the current layout: what it holds itself
    (``Strategy.local_state``: whole entries, or its rows of sharded ones, so no layout
    gathers), each written once: a piece several ranks hold alike (a replica) by the least
    loaded of them. The tensors are the live ones where the layout allows (no copy here;
    ``ShardWriter.begin`` copies)."""
    local = strategy.local_state()
    rows = strategy.local_rows()
    ids: dict[str, tuple[str, torch.Tensor, int, tuple[int, ...] | None]] = {}
    for k, t in local.items():
        shape, r = rows.get(k, (tuple(t.shape), None))
        if r is None:
            ids[k] = (k, t, 0, None)
        else:
            ids[f"{k}@{r[0]}:{r[1]}"] = (k, t, int(r[0]), tuple(shape))
    for key, state in rng_states(rank, device).items():
        ids[key] = (key, state, 0, None)
    mine = {i: v[1].numel() * v[1].element_size() for i, v in ids.items()}
    holdings: list[Any] = [None] * world
    dist.all_gather_object(holdings, mine, group=_cpu_group())
    owner = assign_writers(holdings)
    return [Piece(k, t, start=a, full_shape=full) for i, (k, t, a, full) in ids.items()
            if owner[i] == rank]


_GLOO: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A gloo group for small CPU-side agreements (NCCL wants device tensors)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO.clear()
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]


def forget_groups() -> None:
    """Drop the cached gloo group (a pooled worker's next job has a new default group, whose
    id may repeat the old one's)."""
    _GLOO.clear()


class Checkpointing:
    """This rank's checkpoint store, its writer (one upload at a time), and the time an
    update waited for a checkpoint's deferred copy (reported with the next step's metrics).

    ``after_step`` runs on the step loop's thread; ``poll``/``done`` on the controller's
    (``ShardWriter`` is built for that). Inactive (``store`` None) without checkpoints.
    """

    def __init__(self, config: JobConfig | WorkerConfig, membership: Membership, layout: Layout,
                 faults: Any = None) -> None:
        self._config = config
        # the fault hooks (``faults.Faults``): (rank, step, generation) on the upload thread,
        # and (rank, step) as a restore begins to read
        self._in_upload: Callable[[int, int, int], None] | None = (
            faults.in_upload if faults is not None else None)
        self._in_restore: Callable[[int, int], None] | None = (
            faults.in_restore if faults is not None else None)
        self._membership = membership
        self._layout = layout
        self.store: CheckpointStore | None = None
        if config.checkpoint_every > 0 or config.checkpoint_uri:
            self.store = job_store(config)
        self._writer: ShardWriter | None = None
        self._stuck: ShardWriter | None = None  # given up, its upload not stopped (_drop_stuck)
        self._writer_rank = -1
        # the checkpoint begun last (the one the writer holds, until it ends) is named
        # (generation, seq): the group generation that began it and how many that group had
        # begun (every rank begins each together), so a name never repeats, also when a
        # rollback repeats a step
        self._gen, self._seq = -1, 0
        self._staged_wait_s = 0.0  # waits for a checkpoint's deferred copy, not yet reported
        self._unhook_update: Any = None

    def due(self, step: int) -> bool:
        """Whether a checkpoint is taken after ``step``: every K steps, and after the last
        whenever the job has checkpoints (a ``checkpoint_uri`` with ``checkpoint_every: 0``
        too: 0 turns off only the periodic ones)."""
        every = self._config.checkpoint_every
        if step + 1 == self._config.max_steps:
            return self.store is not None
        return every > 0 and (step + 1) % every == 0

    @property
    def busy(self) -> bool:
        """Whether this rank's previous checkpoint is not yet committed or abandoned."""
        return self._writer is not None and self._writer.state != "idle"

    def after_step(self, step: int, busy_anywhere: bool,
                   while_waiting: Callable[[], None] | None = None,
                   give_up: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Collective at the boundary after ``step`` (every rank, the same arguments: what
        the control all-reduce agreed): take a due checkpoint, or skip it on every rank if
        a previous one is still not committed anywhere. ``while_waiting`` runs now and then
        while this waits for that commit (the step loop answers the controller's requests
        that need a boundary: the controller commits only after they are answered);
        ``give_up()`` True ends that wait, the checkpoint skipped (the controller needs the
        boundary at once: a preemption notice). Returns the metrics to record."""
        out: dict[str, Any] = {}
        if self.due(step):
            if busy_anywhere and not self._wait_idle(while_waiting, give_up):
                out = {"checkpoint_skipped": step + 1, **self._held()}
            else:
                out = {"checkpoint_begun": step + 1,
                       "checkpoint_blocked_s": self._begin(step + 1),
                       "checkpoint_seq": self._seq}
        if self._staged_wait_s > 0:  # an earlier checkpoint's copy held this step's update
            out["checkpoint_wait_s"] = self._staged_wait_s
            self._staged_wait_s = 0.0
        return out

    def now(self, step: int) -> dict[str, Any]:
        """Collective at a step boundary outside the step loop (a job stopped early takes a
        final checkpoint): begin checkpoint ``step`` now, after the previous one is committed
        (bounded wait; skipped on every rank if it is not). Returns what ``after_step`` would
        record."""
        m = self._membership
        if self.busy_anywhere() and not self._wait_idle():
            return {"checkpoint_skipped": step, "rank": m.rank, "generation": m.generation,
                    **self._held()}
        return {"checkpoint_begun": step, "checkpoint_blocked_s": self._begin(step),
                "checkpoint_seq": self._seq, "rank": m.rank, "generation": m.generation}

    def _held(self) -> dict[str, int]:
        """What this rank's writer still holds (step, and its name): with a skip, so that the
        controller can release a checkpoint nothing will ever commit."""
        w = self._writer
        if w is None or w.state == "idle" or w.step is None:
            return {}
        return {"checkpoint_held": int(w.step), "checkpoint_held_gen": self._gen,
                "checkpoint_held_seq": self._seq}

    def busy_anywhere(self) -> bool:
        """Collective: whether any rank's previous checkpoint is still not committed."""
        return not self._membership.all_ranks(not self.busy)

    def _begin(self, step: int) -> float:
        """Collective: decide which rank writes what, copy it to host memory and start the
        background upload. Returns the seconds training was blocked."""
        t0 = time.perf_counter()
        writer = self._ensure_writer()
        m = self._membership
        pieces = checkpoint_pieces(self._layout.strategy, m.rank, m.world, m.device)
        if self._unhook_update is None:
            self._unhook_update = on_before_update(self._before_update)
        params = self._layout.param_keys
        # parameters and optimizer state change only in a step's update: their host copy runs
        # beside the next step's forward and backward, and the update waits for it; buffers
        # (changed by forward) and everything else are copied now
        # named before begin: a word may come as soon as it is begun
        self._gen, self._seq = m.generation, self._seq + 1 if self._gen == m.generation else 1
        writer.begin(step, pieces, later=lambda k: k.startswith("optim/") or k in params)
        return time.perf_counter() - t0

    def _before_update(self) -> None:
        """Runs before any strategy changes parameters or optimizer state: the deferred host
        copy of a checkpoint must be done by then (time waited counts as blocked)."""
        if self._writer is not None:
            self._staged_wait_s += self._writer.staged()

    def _wait_idle(self, while_waiting: Callable[[], None] | None = None,
                   give_up: Callable[[], bool] | None = None) -> bool:
        """Collective: wait (bounded by ``checkpoint_wait_s``, and by ``give_up()``) until
        this rank's previous checkpoint is committed or abandoned; True on every rank iff all
        are ready. Was: a preemption notice waited out ``checkpoint_wait_s`` here, its node
        lost at its deadline (found by a new user, session 48)."""
        deadline = time.monotonic() + self._config.checkpoint_wait_s
        while self.busy:
            if time.monotonic() > deadline or (give_up is not None and give_up()):
                break
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.005)
        self._drop_stuck()
        return self._membership.all_ranks(not self.busy)

    def _drop_stuck(self) -> None:
        """A writer whose checkpoint was given up but whose upload still has not stopped is
        stuck in a storage call that does not return: it is set aside (closed, its host
        buffer freed, once the call returns) and the next checkpoint gets a new writer. One
        at most: each holds a host copy of this rank's shard, so while one set aside is still
        stuck, a second stuck writer stays, and due checkpoints are skipped (each skip says
        so) until either returns."""
        aside = self._reap()
        w = self._writer
        if w is None or w.state != "uploading" or not w.cancelled:
            return
        if aside is not None:
            log.warning("rank %d: the uploads of checkpoints %s and %s were given up and have "
                        "not stopped; checkpoints are skipped until one does",
                        self._membership.rank, aside.step, w.step)
            return
        log.warning("rank %d: the upload of checkpoint %s was given up and has not "
                    "stopped; a new writer takes the next checkpoint",
                    self._membership.rank, w.step)
        self._stuck, self._writer = w, None

    def _reap(self) -> ShardWriter | None:
        """Close the writer set aside once its storage call has returned (its thread ends,
        its host buffer goes); returns the one still set aside, if any."""
        aside = self._stuck
        if aside is not None and aside.state != "uploading":
            aside.close()
            self._stuck = aside = None
        return aside

    def _ensure_writer(self) -> ShardWriter:
        self._reap()
        rank = self._membership.rank
        if self._writer is None or self._writer_rank != rank:
            if self._writer is not None:
                self._writer.close()  # (it abandons anything in flight first)
            assert self.store is not None, "a checkpoint is due but the job has no store"
            self._writer = ShardWriter(self.store, rank)
            self._writer.on_progress = self._progress(self._writer)
            self._writer_rank = rank
        return self._writer

    def _progress(self, writer: ShardWriter) -> Callable[[int, int], None] | None:
        """``writer``'s progress callback: the ``pause_upload`` fault's hook, if any, told the
        step that writer uploads (a writer set aside may still be writing an earlier one)."""
        hook, m = self._in_upload, self._membership
        if hook is None:
            return None

        def progress(written: int, total: int) -> None:
            step = writer.step
            if step is not None and written > 0:
                hook(m.rank, step, m.generation)
        return progress

    def poll(self) -> dict[str, Any] | None:
        """The upload's outcome: None while uploading or idle, else {"info": ShardInfo dict}
        or {"error": message, "step": step} (the upload is then abandoned)."""
        w = self._writer
        if w is None or w.state in ("idle", "uploading"):
            return None
        try:
            info = w.poll()
        except Exception as e:  # noqa: BLE001 - a failed upload: report it, training goes on
            return {"error": str(e), "step": w.step}
        return {"info": info.to_dict()} if info is not None else None

    def done(self, step: int, committed: bool, generation: int | None = None,
             seq: int | None = None) -> None:
        """The controller committed checkpoint ``step``, named (``generation``, ``seq``), or
        gave it up. Only the checkpoint named is touched: step numbers repeat after a
        restore, and this call may arrive late (the controller does not wait for it), after
        the writer began another one."""
        w = self._writer
        if w is None or w.state == "idle" or w.step != step:
            return
        if generation is not None and generation != self._gen or \
                seq is not None and seq != self._seq:
            return
        if committed and w.state == "uploaded":
            try:
                w.committed(step)
            except CheckpointError:  # released meanwhile (a new group formed): nothing held
                pass
        elif not committed:
            self._release(w, f"the controller gave up checkpoint {step}")

    def release_held(self, why: str) -> None:
        """Give up whatever the writer still holds. At ``join`` (a new group generation: a
        checkpoint of an earlier one can never be committed, and the controller abandons it
        at every regroup) and before a restore on the same group (a rollback: the controller
        waited for it to end first), so that a late word about it, in whichever order it
        arrives, cannot meet a new checkpoint of the same step."""
        w = self._writer
        if w is not None and w.state != "idle":
            self._release(w, why)

    def _release(self, w: ShardWriter, why: str) -> None:
        """Abandon the writer's checkpoint without waiting: an upload still writing is
        cancelled at its next write, and the writer goes idle by itself when it stops (a
        stalled storage call must not hold up this call, which shares the actor's thread with
        the controller's others, nor a group's formation). ``w``: the writer checked (the
        step loop may have replaced a stuck one since: ``_drop_stuck``)."""
        try:
            w.abandon(timeout=0.0)
        except CheckpointError as e:
            log.info("rank %d: %s; %s (it goes idle when the upload stops)",
                     self._membership.rank, why, e)

    def restore(self, spec: StrategySpec, step: int, store: Any = None) -> dict[str, Any]:
        """Lay out ``spec`` from committed checkpoint ``step`` of ``store`` (default: the
        job's), checksums verified, each rank reading only what its new layout keeps. The
        torch RNG state and the data position follow the checkpoint."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        source = store or self.store
        if source is None:
            raise CheckpointError("no checkpoint store to restore from: give the store, or "
                                  "set checkpoint_uri or checkpoint_every for the job")
        if self._in_restore is not None:
            self._in_restore(self._membership.rank, step)
        with CheckpointReader(source, step) as reader:
            metas = reader.tensors()
            rank = self._membership.rank
            rngs = [k for k in rng_keys(rank, self._membership.device) if k in metas]

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
                want.update(dict.fromkeys(rngs))
                state = reader.read(want)
                out["rng"] = {k: state.pop(k) for k in rngs}
                out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
                out["total_bytes"] = sum(
                    m.dtype.itemsize * math.prod(m.full_shape)
                    for k, m in metas.items() if not k.startswith("rng/"))
                return state

            self._layout.build_fresh(spec, None, read=read)
        set_rng_states(out["rng"], rank, self._membership.device)
        self._layout.next_step = step
        return {"seconds": time.perf_counter() - t0, "bytes": out["bytes"],
                "total_bytes": out["total_bytes"]}

    def close(self) -> str:
        """Stop the writer (an upload in flight is abandoned: it stops at its next write). A
        writer whose upload does not stop within ``CLOSE_WAIT_S`` (at once when it was given
        up already) is stuck in a storage call and left to its thread, since waiting for it
        would hold up the end of the job: returns what was left so (a pooled worker is then
        retired), else "". The controller's give-up word is not waited for: it is sent
        without an answer, and the end of the job can overtake it. Its hook before each
        update goes too (the process's list held this job's layout, data and model for the
        next job on a pooled worker)."""
        if self._unhook_update is not None:
            self._unhook_update()
            self._unhook_update = None
        left = []
        for w in (self._writer, self._stuck):
            if w is None:
                continue
            if w.state == "uploading":
                try:
                    w.abandon(timeout=0.0 if w.cancelled else CLOSE_WAIT_S)
                except CheckpointError:
                    left.append(f"the upload of checkpoint {w.step} is stuck in a storage call")
                    continue
            w.close()
        self._writer = self._stuck = None
        return "; ".join(left)
