"""Pipeline parallelism (``torch.distributed.pipelining``) and pipeline x data-parallel hybrids.

The model must be pipeline-ready (``strategies.blocks``: an ``nn.Sequential``, or a module
with ``pipeline_blocks()``). A stage is a module that registers its blocks under their
*original* names (``layers.0.weight`` stays ``layers.0.weight``), so canonical states match
every other layout.

Layout (``spec.pp_degree = P``, ``D = world_size // P`` replicas)
-----------------------------------------------------------------
Ranks are stage-major on a (pp, dp) mesh: rank ``r = s * D + j`` runs pipeline stage ``s`` of
replica ``j``. The P ranks ``{s * D + j : s < P}`` of replica ``j`` form its pipeline group; the
D ranks ``{s * D + j : j < D}`` of stage ``s`` form its data-parallel group (sub-groups are
created only when D > 1 and destroyed by ``close()``). With ``schedule="interleaved"``
there are ``2 P`` stages and rank ``s * D + j`` runs stages ``s`` and ``s + P``. ``P == world_size``
is a pure pipeline (D = 1, ``dp_mode`` ignored); ``P < world_size`` is a hybrid.

``spec.stage_split`` gives the number of blocks per stage (one entry per stage); ``None``
splits contiguously, minimising the largest stage's parameter count. ``spec.dp_mode`` picks the
data parallelism inside each stage's dp group: ``dp`` (all-reduce), ``zero1``/``zero2``
(``strategies.zero.ShardedUpdate``) or ``zero3`` (FSDP2 over the dp group).

Shares, micro-batches, loss
---------------------------
Feeding is the same as for every other strategy: ``sum(shares) == G`` and rank ``r`` is given
its own contiguous slice of ``shares[r]`` samples of the step's G samples. The batch of
replica ``j`` is the union of its ranks' slices, ``B_j = sum(shares[s * D + j] for s)``: at each
step the replica's ranks all-gather their slices (inputs and targets, in stage order) over the
pipeline group, so the first stage sees all B_j inputs and the last stage all B_j targets. Only
the sums B_j decide the work; how they are split among the ranks of a replica is free (a
balancer should balance the B_j across replicas). ``spec.micro_batches = M`` splits each B_j
into M equal micro-batches, so M must divide every B_j; 1F1B needs ``M >= P``; interleaved
needs ``M`` to be a multiple of ``max(1, M // P)`` (torch's rule).

Each micro-batch loss is scaled by ``B_j / (M * G)`` (with ``scale_grads=False``), so a stage's
accumulated gradient is its replica's part of the mean over the G samples; the dp group then
sums (dp/zero1/zero2; FSDP's mean is undone by a further factor D). ``train_step`` returns
``replica_mean_loss * B_j / G`` on ranks that hold the last stage and ``0.0`` on all others,
so the sum over all ranks is the global mean loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._gather import gather_union, new_subgroups
from .base import LossFn, OptimizerFactory, Runtime, Strategy, before_update, grad_sq_sum
from .blocks import buffers_kept as _buffers_kept
from .blocks import pipeline_blocks
from .canonical import CanonicalState, model_state_to_canonical
from .errors import StrategyError
from .factory_check import check_factory
from .fsdp import (
    ShardMap,
    load_sharded_state,
    release_mesh,
    shard_module,
    sharded_counts,
    sharded_full_state,
    unshardable,
)
from .items import counts_items, item_count, per_item
from .spec import StrategySpec
from .traits import DP_MODES, SCHEDULES
from .zero import ShardedUpdate, owned_needs, update_subsets

__all__ = ["Pipeline", "balanced_split", "replica_batches", "SCHEDULES"]



def balanced_split(weights: Sequence[int], stages: int) -> tuple[int, ...]:
    """Blocks per stage: a contiguous split into ``stages`` non-empty parts that minimises the
    heaviest part; ties are broken deterministically."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise StrategyError(f"cannot split {n} blocks into {stages} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest heaviest part when splitting the first i blocks into k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], prefix[i] - prefix[j])
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    sizes = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def replica_batches(spec: StrategySpec) -> list[int]:
    """``B_j``: samples per step of each data-parallel replica ``j`` (the sum of the shares of
    its ranks ``j, D + j, 2 D + j, ...``). Raises ``StrategyError`` when the degrees do not
    multiply to the world size."""
    d = spec.degrees.dp
    return [sum(spec.shares[j::d]) for j in range(d)]


class _Stage(nn.Module):
    """Some consecutive blocks of a pipeline-ready model, under their original FQNs. The
    stage's own attributes have names no model's blocks take (``_stage_*``): a model keeping
    its blocks in ``self.blocks`` names them ``blocks.0``, ``blocks.1``, ..., and the stage's
    list was once an attribute ``blocks`` too (torch refused the second assignment)."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]],
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
                 ) -> None:
        super().__init__()
        for name, block in blocks:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            if name.split(".")[0].startswith("_stage_"):
                raise StrategyError(f"block {name!r}: names starting with '_stage_' are the "
                                    "pipeline stage's own; rename that attribute of the model")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]  # type: ignore[assignment]
            parent.add_module(leaf, block)
        self._stage_autocast = autocast or contextlib.nullcontext
        self._stage_blocks = [block for _, block in blocks]  # a plain list: not registered twice

    @property
    def stage_blocks(self) -> list[nn.Module]:
        """The stage's blocks, in order."""
        return self._stage_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # an activation received from the stage before
            x = _ContiguousGrad.apply(x)
        with self._stage_autocast():
            for block in self._stage_blocks:
                x = block(x)
        # sent as it is by torch's p2p, which refuses a strided view (an LSTM's batch-first
        # output, a transpose)
        return x.contiguous()


@functools.cache
def _quiet_stage_class() -> type[Any]:
    """torch's ``PipelineStage``, whose metadata inference (the first step of a stage) runs
    the stage's forward once more in training mode, on an uninitialised tensor past the
    first stage: a BatchNorm took its running statistics from that memory (1e10 to 1e36,
    inf). Here the stage's buffers are put back after it, after the backward inference too
    (with activation checkpointing it runs the blocks' forwards again)."""
    from torch.distributed.pipelining import PipelineStage

    class QuietStage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with _buffers_kept(self.submod):  # torch 2.13
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with _buffers_kept(self.submod):  # torch 2.13
                return super()._backward_metadata_inference(*args, **kwargs)

        def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
            with _buffers_kept(self.submod):  # torch before 2.12 (GPU images ship 2.11)
                return super()._shape_inference(*args, **kwargs)  # type: ignore[misc]

    return QuietStage


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a received
    activation is sent back to the stage before, and a block that starts with a transpose
    hands back a strided one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def _resolve_split(spec: StrategySpec, blocks: Sequence[tuple[str, nn.Module]]) -> tuple[int, ...]:
    n_stages = spec.pp_degree * _stages_per_rank(spec.schedule)
    if n_stages > len(blocks):
        raise StrategyError(
            f"{n_stages} pipeline stages but the model has only {len(blocks)} block"
            f"{'s' if len(blocks) != 1 else ''}; "
            "lower pp_degree (or use a non-interleaved schedule)"
        )
    if spec.stage_split is None:
        weights = [sum(p.numel() for p in b.parameters()) + 1 for _, b in blocks]
        return balanced_split(weights, n_stages)
    split = tuple(spec.stage_split)
    if len(split) != n_stages or any(s < 1 for s in split) or sum(split) != len(blocks):
        raise StrategyError(
            f"stage_split {list(split)} must have {n_stages} entries >= 1 that sum to the "
            f"model's {len(blocks)} blocks"
        )
    return split


class Pipeline(Strategy):
    """Pipeline parallelism, alone or x dp/zero on a 2-D mesh (see the module docstring).

    Ownership: the stages take this rank's blocks out of the given model (the same module
    objects, moved to the device); the strategy keeps no reference to the rest, so a caller
    that drops the full model holds only its stage. ``local_model()`` is this rank's first
    stage.
    """

    name = "pipeline"

    @classmethod
    def validate(cls, spec: StrategySpec, model: nn.Module) -> None:
        super().validate(spec, model)
        pp, world, d = spec.pp_degree, spec.world_size, spec.degrees.dp
        if pp < 2:
            raise StrategyError(
                f"pipeline needs pp_degree >= 2 (got {pp}); for one stage use dp or zero1/2/3"
            )
        if spec.schedule not in SCHEDULES:
            raise StrategyError(
                f"unknown pipeline schedule {spec.schedule!r}; choose one of {SCHEDULES}"
            )
        if spec.dp_mode not in DP_MODES:
            raise StrategyError(f"unknown dp_mode {spec.dp_mode!r}; choose one of {DP_MODES}")
        if spec.dp_mode == "zero3" and (why := unshardable(model)):
            raise StrategyError(f"dp_mode {why}")
        v = spec.options.virtual_stages
        if v != 1 and v != _stages_per_rank(spec.schedule):
            raise StrategyError(
                f"virtual_stages {v}: the {spec.schedule} schedule runs "
                f"{_stages_per_rank(spec.schedule)} stage(s) per rank")
        _resolve_split(spec, pipeline_blocks(model))
        m = spec.micro_batches
        if m < 1:
            raise StrategyError(f"micro_batches must be >= 1, got {m}")
        for j, b in enumerate(replica_batches(spec)):
            if b % m:
                raise StrategyError(
                    f"{m} micro-batches do not divide replica {j}'s batch of {b} samples (the "
                    f"sum of the shares of ranks {list(range(j, world, d))}); make every "
                    "replica's batch a multiple of micro_batches"
                )
        if spec.schedule == "1f1b" and m < pp:
            raise StrategyError(f"1f1b needs micro_batches >= pp_degree ({pp}), got {m}")
        if spec.schedule == "interleaved" and m % max(1, m // pp):
            raise StrategyError(
                f"interleaved needs micro_batches to be a multiple of max(1, micro_batches "
                f"// pp_degree) = {max(1, m // pp)}, got {m}; use a multiple of {pp}"
            )

    def __init__(
        self,
        spec: StrategySpec,
        rt: Runtime,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
    ) -> None:
        super().__init__(spec, rt, model, optimizer_factory, loss_fn)
        self.validate(spec, model)
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self._meshes: list[object] = []  # FSDP meshes (zero3 mode), released at close
        self._stage_keys: set[str] | None = None  # model entries of this rank's stages
        self.pending_update = False  # gradients complete, update not applied (see train_step)
        self._index: ShardMap | None = None  # zero3 inside: where its shards lie
        pp, d = spec.degrees.pp, spec.degrees.dp
        self.mode = spec.dp_mode if d > 1 else "dp"
        blocks = pipeline_blocks(model)
        split = _resolve_split(spec, blocks)
        self.n_stages = len(split)
        starts = [sum(split[:i]) for i in range(self.n_stages)]
        cast = (functools.partial(torch.autocast, rt.device.type, dtype=torch.bfloat16)
                if self.precision == "bf16" else None)  # no reference back to the strategy
        # every stage (the same blocks, not copied): every rank checks every rank's optimizer
        # build, so all refuse alike, before any collective
        stages = [_Stage(blocks[starts[i] : starts[i] + split[i]], cast)
                  for i in range(self.n_stages)]
        self._check_factory(optimizer_factory, model, stages)
        self.stage_rank, self.replica = divmod(rt.rank, d)
        self._own_groups: list[dist.ProcessGroup] = []
        if d > 1:  # every rank creates every group, in the same order
            dp_groups = new_subgroups([[s * d + j for j in range(d)] for s in range(pp)])
            pp_groups = new_subgroups([[s * d + j for s in range(pp)] for j in range(d)])
            self.dp_group = dp_groups[self.stage_rank]
            self.pp_group = pp_groups[self.replica]
            self._own_groups = [g for g in (self.dp_group, self.pp_group) if g is not None]
        else:
            self.dp_group, self.pp_group = None, None
        dp_ranks = [self.stage_rank * d + j for j in range(d)]

        self.stage_ids = [self.stage_rank + k * pp for k in range(_stages_per_rank(spec.schedule))]
        self.stages = [stages[i].to(rt.device) for i in self.stage_ids]
        del stages  # the other ranks' stages: no reference kept
        reshard = spec.options.reshard_after_forward
        if self.mode == "zero3":
            for st in self.stages:
                self._meshes.append(shard_module(st, self.dp_group, rt.device, st.stage_blocks, reshard))
            params = [p for st in self.stages for p in st.parameters()]
            self.optimizer: torch.optim.Optimizer | None = optimizer_factory(params)
            self.update = None
            fsdp_factor = d  # FSDP averages over the dp group; undo that
        else:
            named = [np for st in self.stages for np in st.named_parameters()]
            self.update = ShardedUpdate(
                named,
                optimizer_factory,
                self.mode,
                group=self.dp_group,
                ranks=dp_ranks if d > 1 else [rt.rank],
            )
            self.optimizer = None
            fsdp_factor = 1
        g, m = spec.global_batch_size, spec.micro_batches
        self._slices = [spec.shares[s * d + self.replica] for s in range(pp)]
        self._mb_scale = sum(self._slices) * fsdp_factor / (m * g)
        self._fsdp_factor = fsdp_factor  # (the loss it returns: x 1 / this)
        # a loss that counts items (``strategies.items``): each micro-batch's mean times its
        # items times this (fsdp_factor over the global batch's items; 1 to score an eval)
        self._per_item: torch.Tensor | None = None
        pstages = [
            _quiet_stage_class()(st, i, self.n_stages, rt.device, group=self.pp_group)
            for st, i in zip(self.stages, self.stage_ids, strict=True)
        ]
        self.is_first = 0 in self.stage_ids
        self.is_last = self.n_stages - 1 in self.stage_ids
        self.schedule: Any
        if spec.schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(
                list(pstages), m, loss_fn=self._mb_loss, scale_grads=False  # type: ignore[arg-type]
            )
        else:
            cls = ScheduleGPipe if spec.schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(pstages[0], m, loss_fn=self._mb_loss, scale_grads=False)

    def _check_factory(self, factory: OptimizerFactory, model: nn.Module,
                       stages: Sequence[_Stage]) -> None:
        """``check_factory`` on the parameters each rank builds its optimizer on: its stages'
        (zero3 inside: all of them; else the trainable ones, a rank's share under zero1 and
        zero2), built as ``__init__`` builds them."""
        pp, d = self.spec.degrees.pp, self.spec.degrees.dp
        subsets: list[tuple[str, list[nn.Parameter]]] = []
        for s in range(pp):
            mine = [stages[s + k * pp] for k in range(_stages_per_rank(self.spec.schedule))]
            if self.mode == "zero3":
                subsets.append((f"rank {s * d}", [p for st in mine for p in st.parameters()]))
                continue
            trainable = [p for st in mine for _, p in st.named_parameters() if p.requires_grad]
            subsets += [(f"rank {s * d + j}", ps)
                        for j, ps in enumerate(update_subsets(trainable, self.mode, d))]
        share = (f", a rank's share of them under {self.mode}"
                 if self.mode in ("zero1", "zero2") else "")
        check_factory(factory, model, subsets,
                      f"a pipeline builds it on the parameters of a rank's stages{share}")

    def _mb_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = self.loss_fn(output, target)
            if self._per_item is None:
                return loss * self._mb_scale
            return loss * (item_count(self.loss_fn, target) * self._per_item).float()

    def _zero_grad(self) -> None:
        for st in self.stages:
            for p in st.parameters():
                p.grad = None

    def _replica_batch(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather the replica's slices over the pipeline group, in stage order."""
        t = t.to(self.rt.device)
        if t.shape[0] != self.share:
            raise ValueError(
                f"rank {self.rt.rank} was fed {t.shape[0]} samples, its share is {self.share}"
            )
        top = max(self._slices)
        padded = t.new_zeros((top, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in self._slices]
        dist.all_gather(parts, padded, group=self.pp_group)
        return torch.cat([p[:n] for p, n in zip(parts, self._slices, strict=True)])

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Feed this rank's own share; see the module docstring for the loss it returns."""
        self._zero_grad()
        self.running().hold()
        inputs, targets = self._replica_batch(inputs), self._replica_batch(targets)
        self._per_item = per_item(self.loss_fn, targets, self.rt.device, self.dp_group,
                                  self._fsdp_factor)
        args = (inputs,) if self.is_first else ()
        target = targets if self.is_last else None
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *args, target=target, losses=losses if self.is_last else None, return_outputs=False
        )
        if self.update is not None:
            self.update.reduce_grads()
        self.sync_running_stats()
        # the global norm (one world all-reduce; clipping with it) before the commit below,
        # see clip_grads; not finite: no rank commits or updates (all see the same norm)
        if not self.update_allowed():
            return self._loss(losses)
        # Every rank's gradients are complete: step everywhere or nowhere. Without this, a
        # node lost between two stages' dp reductions leaves stage 0 at step s+1 and stage 1
        # at s, and no step has a live holder of every entry (docs/architecture.md). The
        # all-reduce can still complete on some ranks and fail on others; a rank that got
        # this far can then finish its step later (``finish_pending_step``).
        self.pending_update = self.update is not None and self.update.mode == "dp"
        dist.all_reduce(torch.ones(1, device=self.rt.device))
        self.pending_update = False
        if self.update is not None:
            self.update.step()
        else:
            assert self.optimizer is not None
            before_update()
            self.optimizer.step()
        return self._loss(losses)

    def sync_running_stats(self) -> None:
        """Over the stage's replicas (its dp group; at dp 1 its one holder), each weighted by
        its replica's batch."""
        self.running().average(sum(self._slices) / self.spec.global_batch_size, self.dp_group,
                               alone=self.dp_group is None)

    def _stats_modules(self) -> list[nn.Module]:
        return list(self.stages)

    def _loss(self, losses: list[torch.Tensor]) -> float:
        """What ``train_step`` returns: the replica's loss share on the last stage, else 0."""
        if not self.is_last:
            return 0.0
        return float(sum(float(x.detach()) for x in losses)) / self._fsdp_factor

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Forward only through the schedule (``eval``), in eval mode and without gradients,
        on an evaluation batch split like a training batch (each rank its share: the
        stages' buffers have the training shapes). The last stage of each replica scores
        it; every other rank returns ``(0.0, 0)``."""
        inputs, targets = self._replica_batch(inputs), self._replica_batch(targets)
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        items = counts_items(self.loss_fn)  # then each micro-batch's mean x its items
        self._per_item = (torch.ones((), dtype=torch.float64, device=self.rt.device) if items
                          else None)
        for st in self.stages:
            st.eval()
        try:
            with torch.no_grad():
                self.schedule.eval(*args, target=targets if self.is_last else None,
                                   losses=losses if self.is_last else None)
        finally:
            self._per_item = None
            for st in self.stages:
                st.train()
        if not self.is_last:
            return 0.0, 0
        if items:
            return sum(float(x) for x in losses), int(item_count(self.loss_fn, targets))
        n = len(targets)
        per_mb = n / self.spec.micro_batches  # micro-batches are equal (validate)
        return sum(float(x) for x in losses) / self._mb_scale * per_mb, n

    def clip_grads(self) -> None:
        """Stages hold disjoint parameters: each rank adds its part of its stage's squared
        norm (zero3 inside: its shards; dp, zero1, zero2 inside: each element once per
        stage, see ``ShardedUpdate.grad_sq_part``) and one world all-reduce sums them. It
        runs before the step's commit all-reduce, so a rank left with a pending update has
        its gradients clipped already and ``finish_pending_step`` needs no communication."""
        if self.update is None:
            grads: list[torch.Tensor | None] = [p.grad for st in self.stages
                                                 for p in st.parameters()]
            sq = grad_sq_sum(grads, self.rt.device)
        else:
            grads = self.update.stepped_grads()
            sq = self.update.grad_sq_part(self.rt.device)
        self._clip_by(sq, grads)

    def finish_pending_step(self) -> bool:
        """After a failure inside the step's final all-reduce: apply this rank's update (its
        gradients were complete and reduced) without any communication, if its layout allows
        (dp inside the pipeline: every rank steps its own full optimizer). True if stepped.
        The caller decides: only when a peer is known to have applied the same step."""
        if not self.pending_update or self.update is None:
            return False
        self.update.step()  # mode "dp": a local optimizer step, no collective
        self.pending_update = False
        self.running().redo()  # the step's statistics with it (``step_failed`` took them back)
        return True

    def full_state(self) -> CanonicalState:
        if self.update is None:  # zero3 inside: all-gather the stage within its dp group first
            partial = sharded_full_state(self.stages, self.optimizer)
        else:
            partial = self.held_state()
        return gather_union(partial, self.rt.device)

    def load_full_state(self, state: CanonicalState) -> None:
        self._zero_grad()
        if self.update is None:
            load_sharded_state(self.stages, self.optimizer, state)
            return
        for st in self.stages:
            keys = list(st.state_dict())
            missing = [k for k in keys if f"model/{k}" not in state]
            if missing:
                raise KeyError(f"canonical state lacks model entries {missing[:5]}")
            st.load_state_dict({k: state[f"model/{k}"] for k in keys})
        self.update.load_optim_state(state)

    def needs(self, key: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
        """This rank's stages only: their model entries, and the optimizer entries it steps
        (all of its stages' under dp, the owned ones under zero1/2, its rows under zero3)."""
        if self.update is None:
            return self._shards().needs(key, shape)
        if self._stage_keys is None:
            self._stage_keys = {k for st in self.stages for k in st.state_dict()}
        return owned_needs(key, self.update.owned, self._stage_keys)

    def _shards(self) -> ShardMap:
        if self._index is None:
            self._index = ShardMap(self.stages)
        return self._index

    def local_state(self) -> CanonicalState:
        """Its stages' model entries and the optimizer entries it steps (zero3: its rows);
        no copies on CPU."""
        if self.update is None:
            return self._shards().local(self.optimizer)
        out: CanonicalState = {}
        for st in self.stages:
            out.update(model_state_to_canonical(st.state_dict().items(), copy=False))
        out.update(self.update.optim_state(copy=False))
        return out

    def local_rows(self) -> dict[str, tuple[tuple[int, ...], tuple[int, int] | None]]:
        if self.update is None:
            return self._shards().rows(self.optimizer)
        return super().local_rows()

    def load_state(self, state: CanonicalState) -> None:
        if self.update is not None:
            self.load_full_state(state)  # it takes its stages' entries and ignores the rest
            return
        self._zero_grad()
        load_sharded_state(self.stages, self.optimizer, state, sliced=True)

    def memory_counts(self) -> dict[str, int]:
        if self.update is None:
            return sharded_counts(self.stages, self.optimizer)
        params = [p for st in self.stages for p in st.parameters()]
        return {
            "params": sum(p.numel() for p in params),
            "grads": self.update.grad_count(),
            "optim": self.update.optim_count(),
        }

    def local_model(self) -> nn.Module:
        """This rank's stage (the first of its two stages when interleaved)."""
        return self.stages[0]

    def close(self) -> None:
        if self.update is not None:
            self.update.close()
        for mesh in self._meshes:
            release_mesh(mesh)
        self._index = None  # it holds the stages' DTensors (and so their mesh's group)
        del self.schedule, self.stages, self.optimizer, self.update, self._meshes
        for g in self._own_groups:
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):
                pass  # already gone: the default group was torn down first (after a loss)
        self._own_groups = []
