"""The Strategy contract: how a model, its optimizer and a batch are laid out on a group.

A strategy knows PyTorch, not Ray. It is built on every rank of an already initialised
``torch.distributed`` default group, from a *full* model that is identical on every rank
(same seed, same factory), and it must be able to export and import the training state in one
canonical, layout-independent form:

``CanonicalState`` is a flat ``dict[str, Tensor]`` of CPU tensors:
  - ``"model/<fqn>"``: every parameter and buffer of the full model, by its fully qualified
    name in the *original* model (pipeline stages keep these names);
  - ``"optim/<fqn>/<key>"``: each per-parameter optimizer state entry (``exp_avg``,
    ``momentum_buffer``, ``step``...), full-sized, keyed by the parameter's FQN.
Any strategy's ``full_state()`` loads into any other strategy's ``load_full_state()`` on any
world size; that is what makes live switches and resharding checkpoints possible.

Loss normalisation: each rank gets a *share* of the global batch of size G (shares may be
unequal). ``train_step`` scales the local mean loss by ``share / G`` (times whatever factor
the layout's gradient reduction divides by), so the reduced gradient is exactly the mean over
the G samples, whatever the split.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "StrategyError",
    "StrategySpec",
    "Runtime",
    "Strategy",
    "CanonicalState",
    "LossFn",
    "OptimizerFactory",
    "optimizer_state_to_canonical",
    "optimizer_state_from_canonical",
    "model_state_to_canonical",
    "state_hash",
    "check_layout",
    "on_before_update",
    "before_update",
    "grad_sq_sum",
    "clip_coefficient",
    "PRECISIONS",
    "micro_batch_count",
    "checkpoint_blocks",
    "lockstep_micro_batches",
]

PRECISIONS = ("fp32", "bf16")

CanonicalState = dict[str, torch.Tensor]
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
    tensor on ``device``. Gradient clipping sums these over a cover of the full gradient in
    which every element appears exactly once, then takes the square root."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        if local.numel():
            total += torch.linalg.vector_norm(local.detach(), 2, dtype=torch.float64) ** 2
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies every gradient by: 1 unless the
    norm exceeds ``max_norm`` (the same ``1e-6`` guard)."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def micro_batch_count(spec: StrategySpec, n: int) -> int:
    """How many micro-batches (gradient accumulation passes) a dp or ZeRO rank runs its
    ``n`` samples in: at least the spec option ``accumulation_steps`` (the planner's, when
    activations do not fit), enough for at most ``micro_batch_size`` samples each (the
    job's), never more than ``n``."""
    k = int(spec.options.get("accumulation_steps", 1))
    cap = spec.options.get("micro_batch_size")
    if cap:
        k = max(k, -(-n // int(cap)))
    return max(1, min(k, n))


class StrategyError(ValueError):
    """A strategy cannot run with this spec, world size or model; the message says why."""


def lockstep_micro_batches(spec: StrategySpec) -> int:
    """The micro-batch count of a layout whose every micro-batch is a collective on every
    rank (zero3: each forward all-gathers; zero2: each backward reduces to the owners): the
    largest share's, on every rank. Raises ``StrategyError`` when a share cannot fill it."""
    k = micro_batch_count(spec, max(spec.shares))
    if k > min(spec.shares):
        raise StrategyError(
            f"micro_batch_size {spec.options.get('micro_batch_size')} makes {k} micro-batches "
            f"per step, and under {spec.name} every rank runs as many, but the smallest share "
            f"is {min(spec.shares)} samples; raise micro_batch_size to at least "
            f"{-(-max(spec.shares) // min(spec.shares))}")
    return k


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing: each block of a pipeline-ready model keeps only its input
    for backward and recomputes the rest (``torch.utils.checkpoint``, non-reentrant, RNG
    state preserved, so dropout recomputes the same mask). The block's ``forward`` is
    replaced on the instance, so parameter names stay those of the model (a
    ``checkpoint_wrapper`` would add a prefix) and hooks of DDP and FSDP2 stay on the block.
    Returns the number of blocks; raises ``StrategyError`` for a model without blocks."""
    from torch.utils.checkpoint import checkpoint

    from .pipeline import pipeline_blocks

    try:
        blocks = pipeline_blocks(model)
    except StrategyError as e:
        raise StrategyError(f"activation checkpointing works block by block: {e}") from None
    for _, block in blocks:
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing to save: no recompute either
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
    return len(blocks)


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy needs to lay itself out. Built by the controller from a plan.

    ``shares[r]`` is rank r's number of samples of the global batch (sum = global batch).
    Pipeline fields are ignored by non-pipeline strategies.
    """

    name: str
    world_size: int
    shares: tuple[int, ...]
    pp_degree: int = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    stage_split: tuple[int, ...] | None = None
    dp_mode: str = "dp"  # inner data-parallel flavour of a hybrid (dp or zero1/2/3)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch_size(self) -> int:
        return sum(self.shares)


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
    """One parallel layout. Subclasses register themselves in ``strategies.registry``.

    Ownership: the strategy owns the model and optimizer it builds; ``close()`` releases
    them and any sub-groups. Not thread-safe: one caller drives a strategy at a time, and all
    ranks call collective methods (``train_step``, ``full_state``, ``load_full_state``) in the
    same order.
    """

    name: ClassVar[str]

    @classmethod
    def validate(cls, spec: StrategySpec, model: nn.Module) -> None:
        """Raise ``StrategyError`` if this strategy cannot run with ``spec`` on ``model``."""
        if len(spec.shares) != spec.world_size:
            raise StrategyError(
                f"{len(spec.shares)} batch shares for {spec.world_size} workers; "
                "give one share per worker"
            )
        if spec.options.get("activation_checkpointing"):
            from .pipeline import pipeline_blocks_or_none

            if pipeline_blocks_or_none(model) is None:
                raise StrategyError(
                    f"activation checkpointing works block by block, and "
                    f"{type(model).__name__} names no blocks; make it an nn.Sequential or give "
                    "it pipeline_blocks() (strategies/pipeline.py)")
        if any(s < 1 for s in spec.shares):
            raise StrategyError(
                f"every worker needs at least one sample per step, shares are {list(spec.shares)}; "
                "raise global_batch_size or use fewer workers"
            )

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
        # gradient clipping by the global norm (spec option ``max_grad_norm``; None: off)
        clip = spec.options.get("max_grad_norm")
        self.max_grad_norm: float | None = float(clip) if clip else None
        self.last_grad_norm: float | None = None  # the norm of the last step, before clipping
        if spec.options.get("activation_checkpointing"):
            checkpoint_blocks(model)  # before any wrapper sees the model
        self.precision = str(spec.options.get("precision", "fp32"))
        if self.precision not in PRECISIONS:
            raise StrategyError(f"unknown precision {self.precision!r}; use one of "
                                f"{', '.join(PRECISIONS)}")

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

    def accumulate(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-batch's backward that is not the step's last: gradients
        accumulate locally and are not reduced. Default: nothing (the layout reduces each)."""
        return contextlib.nullcontext()

    def _wrapped_step(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                      inputs: torch.Tensor, targets: torch.Tensor, scale: float,
                      count: int | None = None) -> float:
        """One step through a wrapper that averages gradients over the world (DDP, FSDP2):
        ``scale`` turns that average into the mean over G. Each micro-batch's mean loss is
        weighted by its part of the share, so the accumulated gradient is the same as one
        pass over the whole share. Returns ``mean_loss * share / G``."""
        dev = self.rt.device
        inputs, targets = inputs.to(dev, non_blocking=True), targets.to(dev, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        n = len(inputs)
        parts = self.chunks(n, count)
        total = 0.0
        for i, (a, b) in enumerate(parts):
            weight = (b - a) / n
            with contextlib.ExitStack() as stack:
                if i < len(parts) - 1:
                    stack.enter_context(self.accumulate(module))
                with self.autocast():
                    loss = self.loss_fn(module(inputs[a:b]), targets[a:b])
                (loss * (scale * weight)).backward()
            total += float(loss.detach()) * weight
        if self.max_grad_norm is not None:
            self.clip_grads()
        before_update()
        optimizer.step()
        return total * self.share / self.spec.global_batch_size

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Forward only, in eval mode and without gradients, on this rank's part of an
        evaluation batch: ``(mean loss x samples, samples)`` of what this rank scored (the
        sums over the world give the mean over the batch). Collective where the layout's
        forward is (every rank calls it once per evaluation batch, with 0 samples if its
        part is empty). Default: the local module, no communication."""
        n = len(inputs)
        if n == 0:
            return 0.0, 0
        return self._scored(self.local_model(), inputs, targets)

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
        return loss * n, n

    def clip_grads(self) -> None:
        """Scale this rank's gradients as ``clip_grad_norm_(model.parameters(), max_norm)``
        would scale the full model's, and record the global norm in ``last_grad_norm``.
        Collective where the layout splits the gradient. Layouts that support
        ``max_grad_norm`` override it."""
        raise StrategyError(f"{self.name} does not support max_grad_norm")

    def _clip_by(self, sq: torch.Tensor, grads: Iterable[torch.Tensor | None],
                 reduce: bool = True) -> None:
        """Sum ``sq`` (this rank's part of the squared global norm) over the world unless
        ``reduce`` is False, then scale ``grads`` (those this rank's optimizer steps)."""
        if reduce:
            dist.all_reduce(sq)
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
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


# --------------------------------------------------------------------------- canonical helpers


def model_state_to_canonical(named: Iterable[tuple[str, torch.Tensor]],
                             copy: bool = True) -> CanonicalState:
    """``copy=False``: CPU tensors are the live ones (views), not copies."""
    return {f"model/{k}": v.detach().to("cpu", copy=copy) for k, v in named}


def optimizer_state_to_canonical(
    optimizer: torch.optim.Optimizer, fqn_of: dict[int, str], copy: bool = True
) -> CanonicalState:
    """Per-parameter optimizer state keyed by the parameter's FQN. ``fqn_of`` maps
    ``id(param)`` to its FQN; parameters without state are skipped. ``copy=False``: CPU
    tensors are the live ones."""
    out: CanonicalState = {}
    for p, st in optimizer.state.items():
        fqn = fqn_of[id(p)]
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"optim/{fqn}/{k}"] = t.detach().to("cpu", copy=copy)
    return out


def optimizer_state_from_canonical(
    optimizer: torch.optim.Optimizer,
    params_by_fqn: dict[str, nn.Parameter],
    state: CanonicalState,
    slicer: Callable[[str, torch.Tensor, nn.Parameter], torch.Tensor] | None = None,
) -> None:
    """Fill ``optimizer.state`` for the given parameters from canonical entries.

    ``slicer(fqn, full_tensor, param)`` cuts the full entry down to what this rank holds
    (identity by default). Scalar entries (such as Adam's ``step``) are copied as they are.
    """
    optimizer.state.clear()
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if not key.startswith("optim/"):
            continue
        fqn, _, k = key[len("optim/"):].rpartition("/")
        if fqn in params_by_fqn:
            by_param.setdefault(fqn, {})[k] = t
    for fqn, entries in by_param.items():
        p = params_by_fqn[fqn]
        st: dict[str, Any] = {}
        for k, t in entries.items():
            if t.dim() == 0:  # scalar entries (Adam's step) stay as they are, on the CPU
                st[k] = t.clone()
            else:
                st[k] = (slicer(fqn, t, p) if slicer else t).clone().to(p.device)
        optimizer.state[p] = st


def state_hash(state: CanonicalState) -> str:
    """A short, order-independent digest of a canonical state (bit-exact comparison)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        if t.numel():  # the tensor's own buffer, no copy
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]


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
