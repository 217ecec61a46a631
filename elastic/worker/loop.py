"""The step loop: a worker trains a segment of steps on its own.

The controller is not in the step path. After each step the ranks agree on its loss, samples,
stop flag and checkpoint state with one small all-reduce, issued asynchronously and waited for
after the *next* step's compute (a synchronous one cost ~5 % of a 30 ms step on 2 cores: one
more rendezvous per step). All ranks read the same values at the same point, so they stop at
the same step (one step after the ask). A step that ends a checkpoint interval or the segment
waits for its own values at once. Evaluation runs between steps.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from clusters.policy import NonFiniteObservation, NonFinitePolicy, Rollback, SkipStep
from clusters.sweep_policy import GateObservation, GatePolicy, Prune, PruneGate
from strategies.spec import eval_passes, rank_micro_batches

from ..config import JobConfig, WorkerConfig
from ..data import even_shares, share_bounds
from ..errors import NonFiniteError
from .checkpointing import Checkpointing
from .faults import Faults, nan_inputs
from .inputs import JobData
from .layout import Layout, compute_blocks
from .membership import Membership, Waitable
from .peer_copies import PeerCopies
from .profiling import Profiler

__all__ = ["StepLoop"]


def _pieces(part: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``part`` in ``k`` contiguous, near-equal pieces (empty ones where it is shorter)."""
    sizes = even_shares(len(part), k)
    return [part[lo:hi] for lo, hi in (share_bounds(sizes, i) for i in range(k))]


@dataclasses.dataclass
class _Pending:
    """A finished step whose control all-reduce is in flight."""

    step: int
    work: Waitable | None
    ctrl: torch.Tensor
    t0: float
    t_end: float
    wall_end: float
    lo: int
    hi: int
    lr: float | None = None  # the lr of the step's update (with an lr_schedule)
    grad_norm: float | None = None  # the global gradient norm before clipping (max_grad_norm)
    eval_loss: float | None = None  # the mean loss over eval_dataset after this step
    ctrl_local_bad: bool = False  # this rank saw a NaN/inf loss or skipped the update
    compute_s: float = 0.0  # seconds inside this rank's blocks' forwards (its own compute)
    gate: PruneGate | None = None  # the pruner's gate at this step, held by this rank


class StepLoop:
    """Runs segments of steps on the live layout, and owns what they produce: the metrics
    the controller drains and the stop flag it sets.

    ``run`` runs on the actor's training thread; ``request_stop``, ``drain`` and
    ``memory_counts`` on its other thread (a segment number, a ``deque``, and a request the
    training thread answers between steps: never a read of the live tensors from the other
    thread). A stop names the segment it is for: the actor's two threads run calls in no
    fixed order, so a stop sent right after its segment was started can arrive before
    ``run`` does, and must still count there.
    """

    def __init__(self, config: JobConfig | WorkerConfig, membership: Membership, layout: Layout,
                 data: JobData, checkpoints: Checkpointing, profiler: Profiler,
                 faults: Faults, copies: PeerCopies | None = None) -> None:
        self._config = config
        self._membership = membership
        self._layout = layout
        self._data = data
        self._checkpoints = checkpoints
        self._profiler = profiler
        self._faults = faults
        self._copies = copies
        self._metrics: deque[dict[str, Any]] = deque()
        self._segment = 0  # the segment run() runs (or ran last)
        self._stops: set[int] = set()  # the segments asked to stop (this one's, or later)
        self._urgent: set[int] = set()  # of those, the ones asked at once (a notice)
        self._stop_lock = threading.Lock()
        self._nonfinite_run = 0  # non-finite steps in a row (agreed by every rank)
        self.at_step: int | None = None  # the step whose iteration runs (an error's step)
        self.at_eval = False  # in the evaluation after ``at_step`` (an error says so)
        self._nonfinite = NonFinitePolicy(config.on_nonfinite, config.max_nonfinite_skips)
        self._running = threading.Lock()  # held by run() for its whole segment
        self._counts_wanted = threading.Event()  # memory_counts asked during a segment
        self._counts_ready = threading.Event()
        self._counts: dict[str, int] = {}
        self._counts_of: Any = None  # a weak reference to the strategy the answer is of
        self._shown_of: Any = None  # ... and to the one whose counts went in the metrics
        self._gate: PruneGate | None = None  # a sweep's pruner decision, handed ahead
        self._agreed: dict[int, float] = {}  # the agreed loss of each recent step
        self._gated_next: int | None = None  # every rank holds a gate for this step

    def memory_counts(self, timeout_s: float = 2.0) -> dict[str, int]:
        """Elements of this rank's live state (``Strategy.memory_counts``), from any thread.

        Read on the training thread: a running segment answers at its next step boundary;
        with none running, it is read here while segments are held off. Never read beside a
        step: a step frees and replaces gradients (``zero_grad``) and optimizer state, and a
        read from the actor's other thread meanwhile is a use-after-free that crashed
        survivors (``free(): corrupted unsorted chunks``, SIGSEGV; issue 13, 5). Raises
        ``TimeoutError`` if no step boundary comes within ``timeout_s`` (a rank blocked in a
        collective: the caller goes on).

        During a segment, the counts read at an earlier boundary of the same layout come
        back at once (a layout's counts change only in its first step). The view's memory
        column does not call this: it comes with the metrics (``_first_counts``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._running.acquire(blocking=False):
                try:
                    strategy = self._layout.strategy
                    assert strategy is not None
                    return strategy.memory_counts()
                finally:
                    self._running.release()
            self._counts_ready.clear()
            self._counts_wanted.set()
            if self._counts_of is not None and self._counts_of() is self._layout.strategy:
                return dict(self._counts)
            if self._counts_ready.wait(0.05):
                return dict(self._counts)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step boundary within {timeout_s:.0f}s to read the "
                                   "memory counts at")

    def _answer_counts(self, strategy: Any) -> None:
        """On the training thread, between steps: answer a pending ``memory_counts``."""
        if self._counts_wanted.is_set():
            self._counts_wanted.clear()
            self._counts = strategy.memory_counts()
            self._counts_of = weakref.ref(strategy)  # (a strong one would keep an old
            #                                             layout's tensors alive)
            self._counts_ready.set()

    def _first_counts(self, strategy: Any) -> dict[str, int] | None:
        """On the training thread, at a layout's first boundary: its memory counts, for that
        step's metrics (None after): the view's memory column comes with the metrics the
        controller drains anyway, never from a call that would wait for a boundary. They
        also answer a later ``memory_counts`` at once."""
        if self._shown_of is not None and self._shown_of() is strategy:
            return None
        self._counts = strategy.memory_counts()
        self._counts_of = self._shown_of = weakref.ref(strategy)
        return dict(self._counts)

    def busy(self) -> bool:
        """Whether a segment is running (on the actor's other thread)."""
        return self._running.locked()

    def wind_down(self, timeout_s: float) -> bool:
        """Ask a running segment to stop and wait up to ``timeout_s`` for it to end; whether
        none runs."""
        if self.busy():
            self.request_stop()
        return self.wait_idle(timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for no segment to run; whether none runs."""
        if not self._running.acquire(timeout=timeout_s):
            return False
        self._running.release()
        return True

    def request_stop(self, segment: int | None = None, urgent: bool = False) -> None:
        """Ask segment ``segment`` (None: the one running, or the last one) to stop after its
        current step; all ranks agree on the same step. A stop for a segment that has not
        started yet holds when it starts; one for a segment that ended never reaches
        another."""
        with self._stop_lock:
            self._stops.add(self._segment if segment is None else segment)
            if urgent:  # a boundary not to wait for a slow upload's commit for
                self._urgent.add(self._segment if segment is None else segment)

    def _stop_asked(self) -> bool:
        return self._segment in self._stops

    def _urgent_stop(self) -> bool:
        return self._segment in self._urgent

    def set_gate(self, gate: PruneGate | None) -> None:
        """A sweep pruner's decision at ``gate.step``, to apply to the loss the ranks agree
        on there (any thread; the ranks apply it only when every one holds this version)."""
        self._gate = gate

    def _held_gate(self, step: int, pending: _Pending | None) -> PruneGate | None:
        """The gate for ``step`` if this rank holds it and every loss it needs (steps after
        the gate's ``through``, before ``step``: agreed, or in flight as ``pending``)."""
        g = self._gate
        if g is None or g.step != step:
            return None
        inflight = pending.step if pending is not None else None
        ok = all(t in self._agreed or t == inflight for t in range(g.through + 1, step))
        return g if ok else None

    def drain(self) -> list[dict[str, Any]]:
        """The metrics recorded since the last drain, oldest first (one dict per step)."""
        out = []
        while self._metrics:
            out.append(self._metrics.popleft())
        return out

    def part_said(self) -> str | None:
        """This rank's part of the step an error came from, in words ("1 sample", "6 samples
        in 3 micro-batches"): a batch-size-dependent failure (a batch norm over one sample)
        names what it got. None outside a step."""
        spec = self._layout.spec
        if spec is None or self.at_step is None or self.at_eval:
            return None
        rank, whose = self._membership.rank, ""
        if spec.name == "pipeline":  # a stage runs its replica's whole batch
            d = spec.degrees.dp
            n, k, whose = sum(spec.shares[rank % d::d]), spec.micro_batches, "its replica's "
        else:
            n = spec.shares[rank]
            k = rank_micro_batches(spec, n)
        said = f"{whose}{n} sample{'' if n == 1 else 's'}"
        return said if k <= 1 else f"{said} in {k} micro-batches"

    def run(self, start: int, end: int, segment: int | None = None) -> dict[str, Any]:
        """Train steps ``start..end-1`` as segment ``segment`` (None: the one after the last;
        the controller numbers its segments, and ``request_stop`` names one); stop early at
        a step boundary if any rank was asked. Collective. Returns
        ``{"status": "done"|"stopped", "next_step": n}``."""
        with self._running:
            with self._stop_lock:
                self._segment = self._segment + 1 if segment is None else segment
                self._stops = {k for k in self._stops if k >= self._segment}
                self._urgent = {k for k in self._urgent if k >= self._segment}
            return self._run(start, end)

    def _run(self, start: int, end: int) -> dict[str, Any]:
        layout, m = self._layout, self._membership
        strategy, spec = layout.strategy, layout.spec
        assert strategy is not None and spec is not None
        layout.trains_on()
        self._gated_next = None
        lo, hi = share_bounds(spec.shares, m.rank)
        pending: _Pending | None = None
        step = start
        while step < end:
            self.at_step = step  # (its eval and the step before's finish count to it too)
            self.at_eval = False
            t0 = time.perf_counter()
            nan = self._faults.at_step(m.rank, step, m.generation)
            self._profiler.refresh(strategy)
            x, y = self._data.batch(step, lo, hi)
            lr = layout.schedule.apply(step)
            self._profiler.take_compute()
            try:
                if nan:
                    x, poisoned = nan_inputs(x, lambda: compute_blocks(strategy))
                    with poisoned:
                        local = strategy.train_step(x, y)
                else:
                    local = strategy.train_step(x, y)
            except BaseException:
                try:
                    strategy.step_failed()  # its state is the step's start again
                except Exception:  # noqa: BLE001 - the step's own error is what counts
                    pass
                raise
            strategy.step_done()
            compute_s = self._profiler.take_compute()
            norm = strategy.last_grad_norm
            layout.next_step = step + 1
            copies = self._copies
            if copies is not None and copies.due(step + 1):  # a buddy's copy of step + 1
                copies.begin(strategy, step + 1)
            busy = 1.0 if self._checkpoints.busy else 0.0
            bad = not math.isfinite(local) or bool(getattr(strategy, "skipped", False))
            gate = self._held_gate(step, pending)
            v = float(gate.version) if gate is not None else 0.0
            ahead = self._gate is not None and self._gate.step == step + 1
            ctrl = torch.tensor([local, 1.0 if self._stop_asked() else 0.0, float(hi - lo), busy,
                                 1.0 if bad else 0.0, copies.flag() if copies else 1.0,
                                 1.0 if gate is not None else 0.0, v, v * v,
                                 1.0 if ahead else 0.0], dtype=torch.float64)
            work = m.ctrl_allreduce(ctrl)
            stop = False
            if pending is not None:  # the previous step's values, reduced meanwhile
                stop = self._finish_step(pending)
            pending = _Pending(step, work, ctrl, t0, time.perf_counter(), time.time(), lo, hi,
                               lr, norm, ctrl_local_bad=bad, compute_s=compute_s, gate=gate)
            if self._eval_due(step):  # between steps: its time counts in neither
                self.at_eval = True  # (left set when it raises)
                pending.eval_loss = self._evaluate()
                self.at_eval = False
            if (self._checkpoints.due(step) or step + 1 == end or stop or m.world == 1
                    or self._gated_next == step):
                # (a group of one has nothing to overlap: its values are known at once, and a
                # stop asked during the step takes effect at its end; a pruner's decision step
                # that every rank knew of a step ahead is decided at its own end)
                stop = self._finish_step(pending) or stop
                pending = None
            step += 1
            self._answer_counts(strategy)
            if stop and step < end:
                return {"status": "stopped", "next_step": step}
        return {"status": "done", "next_step": step}

    def _finish_step(self, p: _Pending) -> bool:
        """Wait for step ``p.step``'s agreed values; record its metrics and take (or skip) a
        checkpoint due after it. Returns whether any rank asked to stop."""
        assert p.work is not None
        p.work.wait()
        p.work = None
        loss, stop, trained, busy, bad, copied, gated, v1, v2, ahead = p.ctrl.tolist()
        skipped = self._check_finite(p.step, bad, bool(p.ctrl_local_bad))
        self._agreed[p.step] = loss
        if len(self._agreed) > 4096:  # gates look back one pruner interval at most
            for t in sorted(self._agreed)[:2048]:
                del self._agreed[t]
        world = self._membership.world
        self._gated_next = p.step + 1 if ahead == world else None  # the same on every rank
        pruned = (p.gate is not None and gated == world and v1 * v1 == world * v2
                  and self._gate_prunes(p.gate))
        note = None
        if self._copies is not None:
            self._copies.settle(copied, self._membership.world)
            note, self._copies.note = self._copies.note, None
        strategy = self._layout.strategy
        memory = self._first_counts(strategy)
        # (a request that needs a boundary is answered while this waits for a commit)
        ckpt = self._checkpoints.after_step(p.step, busy > 0,
                                            lambda: self._answer_counts(strategy),
                                            self._urgent_stop)
        dt = p.t_end - p.t0
        self._metrics.append({
            "step": p.step, "rank": self._membership.rank, "loss": loss, "step_time": dt,
            "samples": p.hi - p.lo, "range": [p.lo, p.hi],
            "samples_per_s": self._config.global_batch_size / dt if dt > 0 else 0.0,
            "time": p.wall_end, "generation": self._membership.generation,
            "global_samples": int(trained), "compute_s": p.compute_s, **ckpt,
            **({"lr": p.lr} if p.lr is not None else {}),
            **({"grad_norm": p.grad_norm} if p.grad_norm is not None else {}),
            **({"eval_loss": p.eval_loss} if p.eval_loss is not None else {}),
            **({"skipped": True} if skipped else {}),
            **({"peer_copies_off": note} if note else {}),
            **({"memory": memory} if memory is not None else {}),
            **({"gate": "prune", "gate_time": time.time()} if pruned else {}),
        })
        return stop > 0 or pruned

    def _gate_prunes(self, g: PruneGate) -> bool:
        """Whether the pruner prunes at ``g.step`` (every rank holds ``g`` and the same
        agreed losses, so every rank answers the same)."""
        values = tuple(self._agreed[t] for t in range(g.through + 1, g.step + 1))
        return isinstance(GatePolicy().decide(GateObservation(g, values)), Prune)

    def _check_finite(self, step: int, bad_ranks: float, mine: bool) -> bool:
        """Act on step ``step``'s agreed finiteness (``bad_ranks``: how many ranks saw a NaN
        or inf loss or skipped the update; the layouts skip an update whose global gradient
        norm is not finite, on every rank alike). Returns whether the step was skipped;
        raises ``NonFiniteError`` on every rank when the policy says stop or roll back."""
        if bad_ranks <= 0:
            self._nonfinite_run = 0
            return False
        self._nonfinite_run += 1
        rank = self._membership.rank
        d = self._nonfinite.decide(NonFiniteObservation(step, self._nonfinite_run,
                                                        rank if mine else None))
        if isinstance(d, SkipStep):
            return True
        raise NonFiniteError(
            f"{d.reason}" + ("" if mine else f" (on {int(bad_ranks)} other rank(s))")
            + (": rolling back to the newest checkpoint" if isinstance(d, Rollback) else
               ". Fix: lower the learning rate, clip gradients (max_grad_norm), check the "
               "data of that step (elastic checkpoints / data_log.jsonl say which samples), "
               "or set on_nonfinite: skip with a larger max_nonfinite_skips"),
            step=step, rank=rank if mine else None, rollback=isinstance(d, Rollback))

    # ------------------------------------------------------------------ evaluation

    def _eval_due(self, step: int) -> bool:
        """Whether the model is evaluated after ``step`` (every N steps, and after the last)."""
        if self._config.eval_dataset is None:
            return False
        every = self._config.eval_every
        return (every > 0 and (step + 1) % every == 0) or step + 1 == self._config.max_steps

    def _evaluate(self) -> float:
        """Collective: the mean loss over the whole eval dataset, in order, in batches of
        ``eval_batch_size`` split evenly across the ranks (every rank takes part in every
        batch, with an empty part if it must: a zero3 forward is a collective). A pipeline's
        stages have training shapes, so it scores batches of G split like training, and
        a last partial batch is padded with its last sample, whose loss a batch of only that
        sample then takes back out (exact when a sample's loss does not depend on the rest
        of its batch, as in eval mode without batch statistics)."""
        spec = self._layout.spec
        assert spec is not None
        n = len(self._data.eval_dataset)  # (the length the driver read: JobData checks it)
        pipeline = spec.name == "pipeline"
        e = spec.global_batch_size if pipeline else (
            self._config.eval_batch_size or self._config.global_batch_size)
        total = torch.zeros(2, dtype=torch.float64)
        for start in range(0, n, e):
            idx = torch.arange(start, min(start + e, n))
            if not pipeline:
                parts = even_shares(len(idx), self._membership.world)
                lo, hi = share_bounds(parts, self._membership.rank)
                passes = eval_passes(spec, parts)  # (the same on every rank)
                for piece in _pieces(idx[lo:hi], passes):
                    total += self._eval_part(piece, idx)
                continue
            # (a schedule's micro-batches bound each forward, as in training)
            pad = e - len(idx)
            if pad:
                last = idx[-1:]
                total += self._eval_share(torch.cat([idx, last.repeat(pad)]), spec.shares)
                total -= self._eval_share(last.repeat(e), spec.shares) * (pad / e)
            else:
                total += self._eval_share(idx, spec.shares)
        total = total.to(self._membership.device)
        dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] else 0.0  # (no kept token: 0, as a
        # padding-only batch scores)

    def _eval_share(self, idx: torch.Tensor, shares: Sequence[int]) -> torch.Tensor:
        """This rank's ``(loss x samples, samples)`` of one evaluation batch split by
        ``shares``."""
        lo, hi = share_bounds(shares, self._membership.rank)
        return self._eval_part(idx[lo:hi], idx)

    def _eval_part(self, part: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """``(loss x samples, samples)`` of one forward over ``part``; an empty part scores
        one sample of ``batch`` and counts none (a collective forward cannot skip)."""
        strategy = self._layout.strategy
        if len(part):
            x, y = self._data.eval_batch(part)
            return torch.tensor(strategy.eval_step(x, y), dtype=torch.float64)
        x, y = self._data.eval_batch(batch[:1])
        return torch.tensor(strategy.eval_empty(x, y), dtype=torch.float64)
