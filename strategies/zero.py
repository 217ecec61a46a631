"""ZeRO-1 and ZeRO-2: every rank holds the full model; optimizer state (and, for ZeRO-2,
gradients at rest) are split among the ranks by parameter ownership.

Design
------
* **Ownership.** Each parameter is owned by exactly one rank of the data-parallel group,
  assigned greedily by size (largest first, to the least loaded rank; ties by position and rank
  index), so every rank derives the same map with no communication. Parameters are never split,
  so the balance is only as fine as the largest parameter.
* **Optimizer.** Each rank builds the user's optimizer with ``optimizer_factory`` over *only* the
  parameters it owns (a rank that owns none has no optimizer). Any per-parameter optimizer
  (Adam, SGD, ...) therefore works unchanged and computes exactly what it computes unsharded.
* **Gradients travel in buckets** (``strategies.buckets``, as DDP's reducer and DeepSpeed's
  reduce buckets do): a bucket (1 MiB first, then up to 25 MiB, in backward order) is sent as
  one flat buffer as soon as backward has produced all its gradients, from post-accumulate-grad
  hooks, so communication overlaps the rest of backward and costs a few messages per step
  instead of one per parameter tensor.
* **ZeRO-1 gradients.** Each bucket is summed over the group with one asynchronous
  ``all_reduce``. Every rank holds full gradients, as with DDP.
* **ZeRO-2 gradients.** Each bucket is staged in a flat buffer and summed with one
  asynchronous ``all_reduce`` (DeepSpeed's ZeRO-2 with ``reduce_scatter: false``); every rank
  drops the gradients it does not own as soon as the bucket is sent and copies back only the
  sums of those it owns, so gradients held at rest are about 1/N (plus two staging buffers).
  Since every rank sees every bucket's sums, the global gradient norm is added up as the
  buckets finish: no message of its own (a reduce per owner per bucket, the earlier way,
  needed a scalar all-reduce for it and measured 0.935x dp on TinyGPT at 2 workers).
* **Update.** Owners step their optimizer, then the updated parameters are broadcast from their
  owners in place: each owner's parameters live in flat chunks of at most a bucket (each
  parameter's ``data`` is a view of its chunk; names, hooks and optimizer keys unchanged), so
  a chunk is sent and received as it is, all chunks in flight at once, the owners' in turn (a
  rank sends its own while it receives the others'), with no copy and no buffer.
* **Loss scaling.** Reductions are sums, and each rank scales its local mean loss by
  ``share / G``, so the summed gradient is exactly the mean over the G samples of the step,
  whatever the split. Only the order of the floating-point additions differs from the
  single-process reference.

``ShardedUpdate`` implements the gradient reduction and the update for one data-parallel group
and is reused by the pipeline hybrids (``dp``, ``zero1``, ``zero2`` inside each stage); there the
same buckets are sent after the pipeline schedule's last backward instead of from hooks.

Canonical state: the model comes from the local replica; optimizer entries are gathered from
their owners (``full_state`` is a collective on the default group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator, Mapping, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ._gather import assign_owners, gather_union, global_ranks
from .base import LossFn, OptimizerFactory, Runtime, Strategy, before_update, grad_sq_sum
from .buckets import BUCKET_BYTES, GradBuckets
from .canonical import (
    CanonicalState,
    model_state_to_canonical,
    optimizer_state_from_canonical,
    optimizer_state_to_canonical,
)
from .factory_check import check_factory
from .spec import StrategySpec, lockstep_micro_batches

__all__ = ["ShardedUpdate", "Zero1", "Zero2", "UPDATE_MODES", "update_subsets"]

UPDATE_MODES = ("dp", "zero1", "zero2")


class ShardedUpdate:
    """Gradient reduction and optimizer update of one data-parallel group.

    ``mode`` is ``"dp"`` (all-reduce, every rank steps a full optimizer), ``"zero1"``
    (all-reduce, owners step, owners broadcast) or ``"zero2"`` (all-reduce from a staging
    buffer, owners keep their sums, owners step, owners broadcast; non-owners keep no
    gradient), each reduction bucketed
    (``strategies.buckets.GradBuckets``). Gradient reductions are sums: the caller
    scales its loss so that the sum is the wanted mean. ``group=None`` is the default group;
    ``ranks`` overrides the group's global ranks (``[own rank]``: a group of one, no
    communication at all).

    Every rank of ``group`` must construct it with the same parameters in the same order and
    call the collective methods (``reduce_grads``/``wait``, ``step``, ``optim_state`` through
    ``gather_union``) in the same order. Ownership: it owns the optimizer it builds; the
    parameters belong to the caller's module.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        optimizer_factory: OptimizerFactory,
        mode: str,
        group: dist.ProcessGroup | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        if mode not in UPDATE_MODES:
            raise ValueError(f"unknown update mode {mode!r}; choose one of {UPDATE_MODES}")
        self.mode = mode
        self.group = group
        self.ranks = list(ranks) if ranks is not None else global_ranks(group)
        self.index = self.ranks.index(dist.get_rank())
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.owner = owners([p for _, p in self.named], mode, len(self.ranks), self.index)
        self.owned = {
            name: p for (name, p), o in zip(self.named, self.owner, strict=True) if o == self.index
        }
        self.fqn_of = {id(p): name for name, p in self.owned.items()}
        self.optimizer = optimizer_factory(list(self.owned.values())) if self.owned else None
        self.buckets = GradBuckets([p for _, p in self.named], self.owner,
                                   "owned" if mode == "zero2" else "all_reduce", group,
                                   self.ranks, self.index, label=mode)
        # zero1/zero2: each owner's parameters live in flat chunks (the parameters are views
        # of them), so the update goes out in place: no copy in, no copy out, no allocation
        self._chunks = (_flat_chunks(self.named, self.owner, len(self.ranks))
                        if mode != "dp" and len(self.ranks) > 1 else [])

    # ------------------------------------------------------------------ gradients

    def attach_hooks(self) -> None:
        """Launch each gradient bucket's reduction from the post-accumulate-grad hooks of
        its parameters, while backward goes on; call ``wait()`` after each backward."""
        self.buckets.attach_hooks()

    @property
    def sync(self) -> bool:
        """False: the hooks let gradients accumulate (a micro-batch that is not the last)."""
        return self.buckets.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.buckets.sync = value

    def wait(self) -> None:
        """Finish the reductions (launching the buckets the hooks have not): every rank holds
        the summed gradients (zero2: only its owned ones; it drops the others)."""
        self.buckets.flush()

    def reduce_grads(self) -> None:
        """Reduce the gradients now, bucket by bucket (without hooks); ranks may differ in
        which parameters have one (``GradBuckets``: presence marks)."""
        self.buckets.flush()

    def zero_grad(self) -> None:
        self.buckets.reset()
        for _, p in self.named:
            p.grad = None

    def stepped_grads(self) -> list[torch.Tensor | None]:
        """The gradients this rank's optimizer steps (all of them in mode ``dp``, else the
        owned parameters'): what gradient clipping scales."""
        if self.mode == "dp":
            return [p.grad for _, p in self.named]
        return [p.grad for p in self.owned.values()]

    def grad_sq_part(self, device: torch.device) -> torch.Tensor:
        """This rank's part of the squared norm of the group's gradient, after the reduction:
        summed over the group's ranks it counts every element once (zero1, zero2: the owned
        parameters' gradients; dp, where every rank steps everything: all of rank 0's)."""
        mine = self.mode != "dp" or self.index == 0
        return grad_sq_sum(self.stepped_grads() if mine else [], device)

    # ------------------------------------------------------------------ update

    def step(self) -> None:
        """Owners step their optimizer; updated parameters go out from their owners."""
        before_update()
        if self.optimizer is not None:
            self.optimizer.step()
        if self.mode == "dp" or len(self.ranks) == 1:
            return
        # every chunk's broadcast in flight at once, the owners' chunks in turn (a rank sends
        # its own while it receives the others'); in place, so it needs no buffer
        works = [dist.broadcast(flat, src=self.ranks[o], group=self.group, async_op=True)
                 for o, flat in self._chunks]
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ state

    def optim_state(self, copy: bool = True) -> CanonicalState:
        """This rank's part of the canonical optimizer state (its owned parameters only)."""
        if self.optimizer is None:
            return {}
        return optimizer_state_to_canonical(self.optimizer, self.fqn_of, copy=copy)

    def load_optim_state(self, state: CanonicalState) -> None:
        """Keep the canonical optimizer entries of the owned parameters (no communication)."""
        if self.optimizer is not None:
            optimizer_state_from_canonical(self.optimizer, self.owned, state)

    def grad_count(self) -> int:
        return sum(p.grad.numel() for _, p in self.named if p.grad is not None)

    def optim_count(self) -> int:
        if self.optimizer is None:
            return 0
        return sum(
            v.numel()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )

    def close(self) -> None:
        self.buckets.close()
        self.optimizer = None


def owners(params: Sequence[nn.Parameter], mode: str, n: int, me: int) -> list[int]:
    """Which of a ``ShardedUpdate`` group's ``n`` ranks updates each of ``params`` (the
    trainable ones, in order): under ``dp`` every rank its own copy (``me``)."""
    if mode == "dp":
        return [me] * len(params)
    return assign_owners([p.numel() for p in params], n)


def update_subsets(params: Sequence[nn.Parameter], mode: str, n: int
                   ) -> list[list[nn.Parameter]]:
    """The parameters each of the ``n`` ranks of a ``ShardedUpdate`` group builds its
    optimizer on (``owners``, as the group itself does)."""
    if mode == "dp":
        return [list(params)] * n
    owner = owners(params, mode, n, 0)
    return [[p for p, o in zip(params, owner, strict=True) if o == r] for r in range(n)]


def owned_needs(key: str, owned: Mapping[str, object], model_keys: Container[str] | None = None
                ) -> bool:
    """``Strategy.needs`` of a layout that holds ``model_keys`` (None: every model entry)
    whole and the optimizer entries of the parameters in ``owned`` whole."""
    if key.startswith("model/"):
        return model_keys is None or key[len("model/"):] in model_keys
    if key.startswith("optim/"):
        return key[len("optim/"):].rpartition("/")[0] in owned
    return False


def _flat_chunks(named: Sequence[tuple[str, nn.Parameter]], owner: Sequence[int], n: int
                 ) -> list[tuple[int, torch.Tensor]]:
    """Move every parameter into a flat chunk of its owner's (one dtype, at most
    ``BUCKET_BYTES`` each, a larger tensor alone): ``p.data`` becomes a view of the chunk, so
    names, modules, hooks and optimizer keys stay those of the parameter. Returns (owner,
    chunk) in the order the broadcasts go: each owner's first chunk, then each owner's
    second, ... (the same on every rank)."""
    per_owner: list[list[list[torch.Tensor]]] = []
    for o in range(n):
        runs: list[list[torch.Tensor]] = []
        for group in _by_dtype([p for (_, p), ow in zip(named, owner, strict=True) if ow == o]):
            used = 0
            for p in group:
                size = p.numel() * p.element_size()
                if not runs or runs[-1][0].dtype != p.dtype or used + size > BUCKET_BYTES:
                    runs.append([])
                    used = 0
                runs[-1].append(p)
                used += size
        per_owner.append(runs)
    out: list[tuple[int, torch.Tensor]] = []
    with torch.no_grad():
        for k in range(max((len(r) for r in per_owner), default=0)):
            for o, runs in enumerate(per_owner):
                if k >= len(runs):
                    continue
                run = runs[k]
                flat = torch.empty(sum(p.numel() for p in run), dtype=run[0].dtype,
                                   device=run[0].device)
                at = 0
                for p in run:
                    flat[at:at + p.numel()].copy_(p.reshape(-1))
                    p.data = flat[at:at + p.numel()].view_as(p)
                    at += p.numel()
                out.append((o, flat))
    return out


def _by_dtype(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault(p.dtype, []).append(p)
    return [buckets[d] for d in sorted(buckets, key=str)]


class _Zero(Strategy):
    """Shared body of ZeRO-1 and ZeRO-2 over the default group (see the module docstring)."""

    mode: ClassVar[str]

    def __init__(
        self,
        spec: StrategySpec,
        rt: Runtime,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
    ) -> None:
        super().__init__(spec, rt, model, optimizer_factory, loss_fn)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # before .to(device): Adagrad's check builds allocate where the model was built (CPU)
        check_factory(optimizer_factory, model,
                      [(f"rank {r}", ps) for r, ps in
                       enumerate(update_subsets(trainable, self.mode, rt.world_size))],
                      f"{self.name} builds it on the parameters a rank owns")
        self.model = model.to(rt.device)
        self.update = ShardedUpdate(
            list(self.model.named_parameters()), optimizer_factory, self.mode
        )
        self.update.attach_hooks()
        self._scale = self.share / spec.global_batch_size

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.update.zero_grad()
        # micro-batches: ZeRO-1 reduces after the last one only; ZeRO-2 reduces each to the
        # owners (whose gradients accumulate the sums; the others drop theirs each time, so
        # gradients stay about 1/N between micro-batches), hence the same count on every rank
        lockstep = self.spec.traits.lockstep_micro_batches
        total = self._micro_batches(self.model, inputs, targets, self._scale,
                                    lockstep_micro_batches(self.spec) if lockstep else None,
                                    self._reduced)
        self.update.sync = True
        self.update.wait()
        self.sync_running_stats()
        if self.update_allowed():  # the global norm, every step (no message: clip_grads)
            self.update.step()
        return total * self._scale

    @contextlib.contextmanager
    def _reduced(self, last: bool) -> Iterator[None]:
        """A micro-batch's pass: its gradients reduced to the owners under ZeRO-2 (waited
        for before the next pass), held back to the last pass under ZeRO-1."""
        self.update.sync = self.mode == "zero2" or last
        yield
        if self.update.sync and not last:
            self.update.wait()

    def clip_grads(self) -> None:
        """Each owner's part of the squared norm, summed over the world (one scalar)."""
        self._clip_by(self.update.grad_sq_part(self.rt.device), self.update.stepped_grads())

    def full_state(self) -> CanonicalState:
        out = model_state_to_canonical(self.model.state_dict().items())
        out.update(gather_union(self.update.optim_state(), self.rt.device))
        return out

    def load_full_state(self, state: CanonicalState) -> None:
        msd = {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}
        self.model.load_state_dict(msd)
        self.update.zero_grad()
        self.update.load_optim_state(state)

    def needs(self, key: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
        """The whole model, and the optimizer entries of the owned parameters only."""
        return owned_needs(key, self.update.owned)

    def local_state(self) -> CanonicalState:
        out = model_state_to_canonical(self.model.state_dict().items(), copy=False)
        out.update(self.update.optim_state(copy=False))
        return out

    def load_state(self, state: CanonicalState) -> None:
        self.load_full_state(state)  # it keeps the owned entries and ignores the rest

    def memory_counts(self) -> dict[str, int]:
        return {
            "params": sum(p.numel() for p in self.model.parameters()),
            "grads": self.update.grad_count(),
            "optim": self.update.optim_count(),
        }

    def local_model(self) -> nn.Module:
        return self.model

    def close(self) -> None:
        self.update.close()
        del self.update, self.model


class Zero1(_Zero):
    """ZeRO-1: optimizer state sharded by parameter ownership; gradients all-reduced."""

    name = "zero1"
    mode = "zero1"

    def clip_grads(self) -> None:
        """Every rank holds the whole all-reduced gradient (identical bytes on every rank),
        so the global norm needs no message, as under dp."""
        grads = [p.grad for _, p in self.update.named]
        self._clip_by(grad_sq_sum(grads, self.rt.device), self.update.stepped_grads(),
                      reduce=False)


class Zero2(_Zero):
    """ZeRO-2: optimizer state and gradients at rest sharded by parameter ownership."""

    name = "zero2"
    mode = "zero2"

    def clip_grads(self) -> None:
        """The buckets' all-reduces gave every rank every sum, and each rank added up their
        squares as they finished (``GradBuckets.last_sq``, bit-equal on every rank): the
        global norm needs no message. In a group of one (no buckets sent), each owner's part
        is summed over the world (one scalar)."""
        sq = self.update.buckets.last_sq
        if sq is None:
            super().clip_grads()
            return
        self._clip_by(sq, self.update.stepped_grads(), reduce=False)
