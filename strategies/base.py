"""The Strategy contract: how a model, its optimizer and a batch are laid out on a group.

A strategy knows PyTorch, not Ray. It is built on every rank of an already initialised
``torch.distributed`` default group, from a *full* model that is identical on every rank
(same seed, same factory), from a ``StrategySpec`` (``strategies.spec``), and it must be able
to export and import the training state in the canonical, layout-independent form
(``strategies.canonical``): any strategy's ``full_state()`` loads into any other strategy's
``load_full_state()`` on any world size.

Loss normalisation: each rank gets a *share* of the global batch of size G (shares may be
unequal). ``train_step`` scales the local mean loss by ``share / G`` (times whatever factor
the layout's gradient reduction divides by), so the reduced gradient is exactly the mean over
the G samples, whatever the split. A loss that averages over items of its own (tokens that
are not padding) is weighted by its items instead (``strategies.items``).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take
# ``group=group.WORLD`` as a default argument, evaluated at import. Imported later (DDP does it
# lazily) they would pin the first default group for the life of the process, and a gloo
# group closes its sockets only when its last reference goes: after a node loss, peers
# blocked on a rank that has left would wait out the group timeout instead of failing at once.
# Every path that builds a strategy or forms a group for one imports this module first (the
# worker imports it at module import; tests/test_strategies_import.py checks it).
import torch.distributed.nn.functional  # noqa: F401
from torch import nn

from .blocks import checkpoint_blocks, checkpointable
from .canonical import CanonicalState
from .errors import StrategyError
from .items import counts_items, item_count, part_weights
from .running_stats import RunningStats, batch_counters, running_stats
from .spec import StrategySpec, micro_batch_count

__all__ = [
    "Runtime",
    "Strategy",
    "LossFn",
    "OptimizerFactory",
    "check_layout",
    "on_before_update",
    "before_update",
    "grad_sq_sum",
    "clip_coefficient",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


_BEFORE_UPDATE: list[Callable[[], None]] = []


def on_before_update(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn()`` right before any strategy in this process changes parameters or
    optimizer state in a step (an optimizer step, or ZeRO's parameter broadcast). Forward and
    backward do not change them, so a caller may read them until then: an asynchronous
    checkpoint copies them while the next step computes. Returns a function that removes it."""
    _BEFORE_UPDATE.append(fn)

    def remove() -> None:
        if fn in _BEFORE_UPDATE:
            _BEFORE_UPDATE.remove(fn)
    return remove


def before_update() -> None:
    """Strategies call this before they update parameters or optimizer state."""
    for fn in list(_BEFORE_UPDATE):
        fn()


def grad_sq_sum(grads: Iterable[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads`` (DTensors count their local shard), as a 0-dim float64
    tensor on ``device``. Gradient clipping and the non-finite check sum these over a cover of
    the full gradient in which every element appears exactly once, then take the square root.

    Each tensor's norm is taken as ``clip_grad_norm_`` takes it (``torch._foreach_norm``, one
    kernel per device and dtype: ~7x faster than a norm per tensor in float64 on CPU, which
    matters since every step computes it); the squares are summed in float64. A NaN or inf
    anywhere makes the sum NaN or inf."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        if local.numel():
            groups.setdefault((local.device, local.dtype), []).append(local.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ts in groups.values():
        norms = torch.stack(torch._foreach_norm(ts, 2))
        total += norms.to(device=device, dtype=torch.float64).square().sum()
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies every gradient by: 1 unless the
    norm exceeds ``max_norm`` (the same ``1e-6`` guard)."""
    return min(1.0, max_norm / (total_norm + 1e-6))


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: rank, world size and torch device of the current group."""

    rank: int
    world_size: int
    device: torch.device

    @staticmethod
    def current(device: torch.device | str = "cpu") -> Runtime:
        return Runtime(dist.get_rank(), dist.get_world_size(), torch.device(device))


class Strategy(ABC):
    """One parallel layout, registered under ``name`` in ``strategies.registry`` and described
    by ``strategies.traits.TRAITS[name]``.

    Ownership: the strategy owns the model and optimizer it builds; ``close()`` releases
    them and any sub-groups. Not thread-safe: one caller drives a strategy at a time, and all
    ranks call collective methods (``train_step``, ``full_state``, ``load_full_state``) in the
    same order.
    """

    name: ClassVar[str]

    @classmethod
    def validate(cls, spec: StrategySpec, model: nn.Module) -> None:
        """Raise ``StrategyError`` if this strategy cannot run with ``spec`` on ``model``:
        the spec's own checks (``StrategySpec.validate``), then what needs the model."""
        spec.validate()
        if spec.options.activation_checkpointing and (why := checkpointable(model)):
            raise StrategyError(f"activation checkpointing works block by block: {why}")

    def __init__(
        self,
        spec: StrategySpec,
        rt: Runtime,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
    ) -> None:
        self.spec = spec
        self.rt = rt
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory
        # gradient clipping by the global norm (option ``max_grad_norm``; None: off)
        self.max_grad_norm: float | None = spec.options.max_grad_norm
        self.last_grad_norm: float | None = None  # the norm of the last step, before clipping
        # the last step's update was skipped on every rank: its global gradient norm was NaN
        # or inf (the worker loop reads it; see update_allowed)
        self.skipped = False
        if spec.options.activation_checkpointing:
            checkpoint_blocks(model)  # before any wrapper sees the model
        self.precision = spec.options.precision
        self._stats: RunningStats | None = None  # see sync_running_stats

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's (and loss's) precision context: ``torch.autocast`` to bfloat16 for
        ``precision: bf16`` (weights, gradients and optimizer state stay fp32, as with
        ``torch.autocast`` in a plain loop), else nothing."""
        if self.precision == "bf16":
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def share(self) -> int:
        return self.spec.shares[self.rt.rank]

    @abstractmethod
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Run one optimizer step on this rank's share; return ``local_mean_loss * share / G``
        (summing the returns of all ranks gives the global mean loss)."""

    @abstractmethod
    def full_state(self) -> CanonicalState:
        """Collective. Return the full canonical state on every rank (CPU tensors)."""

    @abstractmethod
    def load_full_state(self, state: CanonicalState) -> None:
        """Collective. Replace model and optimizer state with ``state`` (canonical form)."""

    def needs(self, key: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
        """What ``load_state`` reads of canonical entry ``key`` (full shape ``shape``):
        ``False`` nothing, ``True`` all of it, ``(a, b)`` rows ``a:b`` of dim 0. A restore
        from a checkpoint reads only that, so a rank reads its shard, not the whole state.
        Valid once the strategy is built. Default: every entry, whole."""
        return True

    def load_state(self, state: CanonicalState) -> None:
        """Collective. Like ``load_full_state``, but ``state`` holds only what ``needs``
        asked for: whole entries, and for a row range only those rows (shape
        ``(b - a, *shape[1:])``). Default: ``load_full_state`` (for layouts that need
        every entry whole)."""
        self.load_full_state(state)

    def local_state(self) -> CanonicalState:
        """Local, no collective: what this rank holds, in the form ``needs`` describes
        (whole entries, and for a row range only those rows), as CPU tensors that may share
        memory with the live state (read them, do not keep them). With ``needs`` it lets a
        caller check a layout piece by piece against a canonical state without a gather.
        Every strategy implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it holds")

    def held_state(self) -> CanonicalState:
        """Local, no collective: the entries this rank holds whole, as CPU copies (what a
        survivor can hand to a new group after a loss). Derived from ``local_state``."""
        rows = self.local_rows()
        return {k: v.detach().to("cpu", copy=True) for k, v in self.local_state().items()
                if rows.get(k, ((), None))[1] is None}

    def local_rows(self) -> dict[str, tuple[tuple[int, ...], tuple[int, int] | None]]:
        """Local: for each ``local_state`` key, the entry's full shape and the dim-0 rows
        this rank holds (None: the whole entry). Default: layouts holding entries whole."""
        return {k: (tuple(v.shape), None) for k, v in self.local_state().items()}

    @abstractmethod
    def memory_counts(self) -> dict[str, int]:
        """Elements this rank actually holds: ``params``, ``grads``, ``optim``."""

    def chunks(self, n: int, count: int | None = None) -> list[tuple[int, int]]:
        """Micro-batches of this rank's ``n`` samples (gradient accumulation): contiguous,
        near-equal ranges of at most ``micro_batch_size`` samples (spec option; None: one
        range), ``count`` of them if given (layouts whose every forward is a collective)."""
        k = count if count is not None else micro_batch_count(self.spec, n)
        base, extra = divmod(n, k)
        out, at = [], 0
        for i in range(k):
            size = base + (1 if i < extra else 0)
            out.append((at, at + size))
            at += size
        return out

    def check_reduced(self) -> None:
        """After a step's last backward: raise ``StrategyError`` where the wrapper did not
        reduce every gradient (it would fail, or pair collectives wrongly, later). Default:
        nothing to check."""
        return

    def accumulate(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-batch's backward that is not the step's last: gradients
        accumulate locally and are not reduced. Default: nothing (the layout reduces each)."""
        return contextlib.nullcontext()

    def _wrapped_step(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                      inputs: torch.Tensor, targets: torch.Tensor, scale: float,
                      count: int | None = None) -> float:
        """One step through a wrapper that reduces gradients over the world (DDP through
        dp's hook: a sum; FSDP2: an average): ``scale`` turns that into the mean over G. Each micro-batch's mean loss is
        weighted by its part of the share (a loss that counts items: by its items,
        ``strategies.items``), so the accumulated gradient is the same as one pass over the
        whole share. Returns this rank's part of the global mean loss."""
        optimizer.zero_grad(set_to_none=True)
        total = self._micro_batches(
            module, inputs, targets, scale, count,
            lambda last: contextlib.nullcontext() if last else self.accumulate(module))
        self.check_reduced()
        self.sync_running_stats()
        if self.update_allowed():
            before_update()
            optimizer.step()
        return total * self.share / self.spec.global_batch_size

    def _micro_batches(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       scale: float, count: int | None,
                       around: Callable[[bool], contextlib.AbstractContextManager[Any]]
                       ) -> float:
        """The forwards and backwards of a step's micro-batches of this rank's share
        (``chunks``), each loss scaled by ``scale`` times its weight (``part_weights``), each
        pass inside ``around(last)``: how the layout reduces (or holds back) its gradients.
        Returns the sum of the weighted mean losses."""
        dev = self.rt.device
        inputs, targets = inputs.to(dev, non_blocking=True), targets.to(dev, non_blocking=True)
        self.running().hold()
        parts = self.chunks(len(inputs), count)
        weights = part_weights(self.loss_fn, targets, parts, self.share,
                               self.spec.global_batch_size, dev)
        total = 0.0
        for i, ((a, b), weight) in enumerate(zip(parts, weights, strict=True)):
            with around(i == len(parts) - 1):
                with self.autocast():
                    loss = self.loss_fn(module(inputs[a:b]), targets[a:b])
                (loss * (scale * weight)).backward()
            total += float(loss.detach()) * weight
        return total

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Forward only, in eval mode and without gradients, on one piece of this rank's
        part of an evaluation batch: ``(mean loss x samples, samples)`` of what this rank
        scored (the sums over the world give the mean over the batch). Collective where the
        layout's forward is (every rank calls it as many times per evaluation batch,
        ``eval_empty`` for an empty piece). Default: the local module, no communication."""
        n = len(inputs)
        if n == 0:
            return 0.0, 0
        return self._scored(self.local_model(), inputs, targets)

    def eval_empty(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """``eval_step`` for a rank whose part of an evaluation batch is empty; ``inputs`` and
        ``targets``: one sample of the batch, for a layout whose forward is collective and
        cannot run on 0 rows (scored, not counted). Returns ``(0.0, 0)``."""
        return self.eval_step(inputs[:0], targets[:0])

    def _scored(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                ) -> tuple[float, int]:
        dev = self.rt.device
        was = module.training
        module.eval()
        try:
            with torch.no_grad(), self.autocast():
                out = module(inputs.to(dev))
                n = len(inputs)
                loss = float(self.loss_fn(out, targets.to(dev))) if n else 0.0
        finally:
            module.train(was)
        if n and counts_items(self.loss_fn):  # the mean over the evaluation set's items
            k = float(item_count(self.loss_fn, targets))
            return loss * k, int(k)
        return loss * n, n

    def running(self) -> RunningStats:
        """The normalisation layers' running statistics this rank holds
        (``strategies.running_stats``); ``hold()`` them before a step's forwards."""
        if self._stats is None:
            mods = self._stats_modules()
            self._stats = RunningStats(running_stats(mods), batch_counters(mods))
        return self._stats

    def step_failed(self) -> None:
        """After ``train_step`` raised (a peer lost inside it): the running statistics and
        their counters as they were at the step's start, as its state is (the step is run
        again from there). Was: a survivor kept what the step's forward had folded in, and
        the replay folded it in again (a BatchNorm job's statistics off by 4e-3 and one batch
        counted twice, found by a new user)."""
        self.running().rewind()

    def step_done(self) -> None:
        """After ``train_step`` returned: nothing of it is to be rewound."""
        if self._stats is not None:
            self._stats.finished()

    def _stats_modules(self) -> list[nn.Module]:
        return [self.local_model()]

    def sync_running_stats(self) -> None:
        """After a step's forwards, on every rank: the running statistics averaged over the
        replicas, each weighted by its share of G, never left non-finite (nothing to do for
        a model without them)."""
        self.running().average(self.share / self.spec.global_batch_size)

    def update_allowed(self) -> bool:
        """Called by every layout on every step once the gradients are reduced, before any
        update: the global gradient norm (``clip_grads``: one scalar all-reduce where the
        gradient is split, none where every rank holds it whole), clipping by it when
        ``max_grad_norm`` is set. When it is NaN or inf (a NaN or inf in any rank's
        gradients), every rank sees the same norm and returns False: the layout then skips
        its optimizer step, its parameter broadcast and anything else the update does, on
        every rank alike, so parameters and optimizer state (Adam's step count included)
        stay as they were. Sets ``skipped`` either way (the worker loop reads it)."""
        self.clip_grads()
        norm = self.last_grad_norm
        self.skipped = norm is None or not math.isfinite(norm)
        return not self.skipped

    def clip_grads(self) -> None:
        """Record the global gradient norm in ``last_grad_norm`` and, with ``max_grad_norm``,
        scale this rank's gradients as ``clip_grad_norm_(model.parameters(), max_norm)``
        would scale the full model's. Collective where the layout splits the gradient.
        Every layout overrides it (``update_allowed`` calls it every step)."""
        raise StrategyError(f"{self.name} does not compute the gradient norm")

    def _clip_by(self, sq: torch.Tensor, grads: Iterable[torch.Tensor | None],
                 reduce: bool = True) -> None:
        """Sum ``sq`` (this rank's part of the squared global norm) over the world unless
        ``reduce`` is False, then scale ``grads`` (those this rank's optimizer steps) when
        ``max_grad_norm`` is set and the norm is finite and above it."""
        if reduce:
            dist.all_reduce(sq)
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
        if self.max_grad_norm is None or not math.isfinite(norm):
            return
        coef = clip_coefficient(norm, self.max_grad_norm or float("inf"))
        if coef < 1.0:
            for g in grads:
                if g is not None:
                    (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)

    def local_model(self) -> nn.Module:
        """The module this rank runs (wrapped or not); for inspection and tests."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - a no-op default is right for most layouts
        """Release the model, optimizer and any sub-groups this strategy created."""


# --------------------------------------------------------------------------- layout check


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN-safe, bit for bit


def check_layout(strategy: Strategy, state: CanonicalState) -> list[str]:
    """Collective over the default group: check, piece by piece and without gathering the
    state, that ``strategy`` holds exactly ``state``: every rank's ``local_state`` pieces are
    bit-equal to the cuts of ``state`` its ``needs`` names, it holds nothing else, and the
    ranks' pieces together cover every row of every entry. Returns the problems found on any
    rank (the same list on every rank; empty: the layout holds ``state`` exactly)."""
    local = strategy.local_state()
    problems: list[str] = []
    cover: dict[str, tuple[int, int] | None] = {}
    for key, full in state.items():
        need = strategy.needs(key, tuple(full.shape))
        if need is False:
            continue
        cover[key] = None if need is True else (int(need[0]), int(need[1]))
        piece = local.get(key)
        want = full if need is True else full[need[0]:need[1]]
        if piece is None:
            problems.append(f"rank {strategy.rt.rank} lacks {key}")
        elif not _same_bits(piece.cpu(), want):
            problems.append(f"rank {strategy.rt.rank} holds a different {key}")
    problems += [f"rank {strategy.rt.rank} holds {k}, which the state has not"
                 for k in sorted(set(local) - set(state))]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (cover, problems))
    problems = [p for _, probs in everyone for p in probs]
    for key, full in state.items():
        rows = [c[key] for c, _ in everyone if key in c]
        if not rows:
            problems.append(f"no rank holds {key}")
        elif None not in rows:
            at = 0
            for a, b in sorted(rows):
                if a > at:
                    break
                at = max(at, b)
            if at < (full.shape[0] if full.dim() else 1):
                problems.append(f"rows {at}: of {key} are held by no rank")
    return problems
