"""What each strategy is, described once: one frozen ``Traits`` per registered name.

The cost model, the planner, the simulator and the controller read this table instead of
spelling strategy names out; ``tests`` check that its keys are the registry's names. It
imports neither torch nor anything that does, so ``clusters/`` (which never imports torch)
can read it: ``import strategies.traits`` loads only this module and the torch-free package
``__init__``.

Model-state memory (the one place this formula is written). ZeRO paper (Rajbhandari et al.
2020, Fig. 1), with psi parameters, ``p``/``g``/``k`` bytes per parameter, gradient and
optimizer-state element, and the data-parallel degree N that shards them:

    dp     p psi   + g psi   + k psi
    zero1  p psi   + g psi   + k psi / N
    zero2  p psi   + g psi/N + k psi / N
    zero3  p psi/N + g psi/N + k psi / N

A pipeline rank holds its stage's parameters (psi = the stage's), laid out inside the stage by
its ``dp_mode`` over the dp degree. On top of the states, a layout holds working buffers:
zero1 and zero2 the flat buffers of the gradient buckets in flight and then of the parameter
broadcasts (``strategies.buckets``: two of at most ``BUCKET_BYTES`` each when the link keeps
up with backward; a single tensor larger than that travels alone), zero3 two units' gathered
parameters (the one running and the one prefetched) and one unit's unsharded gradients, a
unit being its largest FSDP unit (a block).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import StrategyError

__all__ = ["Traits", "StateBytes", "TRAITS", "traits_of", "spec_survives_loss", "DP_MODES",
           "SCHEDULES", "BUCKET_BYTES", "FIRST_BUCKET_BYTES"]

# Gradient buckets of zero1/zero2 (strategies.buckets): DDP's sizes, 1 MiB for the first
# bucket (communication starts early in backward), then 25 MiB (bucket_cap_mb).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model states one rank holds: parameters, gradients, optimizer state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True)
class Traits:
    """What a strategy does with the training state, independent of any code that runs it.

    ``shards_params`` / ``shards_grads`` / ``shards_optimizer``: whether each rank holds only
    a part of the parameters, of the gradients at rest, of the optimizer state (a pipeline:
    each stage its own layers'). ``replicas_survive_loss``: after one rank is lost, every
    entry of the state still has a live holder (dp with at least two ranks; a pipeline only
    through the dp replicas of each stage, see ``survives_loss``). ``lockstep_micro_batches``:
    every micro-batch is a collective on every rank (zero2 reduces each backward to the
    owners, zero3 gathers in each forward), so every rank runs as many as the largest share
    needs. ``pipeline``: stages over ``pp_degree`` ranks (the spec's pipeline fields apply).
    ``buffer_param_units`` / ``buffer_grad_units``: working buffers, in units of the largest
    unit's parameters / gradients; ``buffer_buckets``: working buffers, in gradient buckets
    (see the module docstring).
    """

    name: str
    shards_params: bool
    shards_grads: bool
    shards_optimizer: bool
    replicas_survive_loss: bool
    lockstep_micro_batches: bool
    pipeline: bool = False
    buffer_param_units: int = 0
    buffer_grad_units: int = 0
    buffer_buckets: int = 0

    def survives_loss(self, dp_degree: int, dp_mode: str = "dp") -> bool:
        """Whether every entry still has a live holder after any one rank is lost, with
        ``dp_degree`` data-parallel ranks (a pipeline: of each stage, laid out by
        ``dp_mode``)."""
        if self.pipeline:
            return traits_of(dp_mode).survives_loss(dp_degree)
        return self.replicas_survive_loss and dp_degree >= 2

    def state_bytes(self, n_params: float, degree: int, *, param_bytes: float = 2,
                    grad_bytes: float = 2, optimizer_bytes: float = 12,
                    dp_mode: str = "dp") -> StateBytes:
        """Model-state bytes per rank: ``n_params`` parameters (a pipeline: the stage's),
        sharded ``degree`` ways where this layout shards (a pipeline: as ``dp_mode`` does
        over its dp degree). Defaults: mixed precision with Adam (2 + 2 + 12 bytes)."""
        if self.pipeline:
            return traits_of(dp_mode).state_bytes(n_params, degree, param_bytes=param_bytes,
                                                  grad_bytes=grad_bytes,
                                                  optimizer_bytes=optimizer_bytes)
        if degree < 1:
            raise ValueError(f"degree must be >= 1, got {degree}")

        def part(per: float, sharded: bool) -> float:
            return n_params * per / (degree if sharded else 1)

        return StateBytes(part(param_bytes, self.shards_params),
                          part(grad_bytes, self.shards_grads),
                          part(optimizer_bytes, self.shards_optimizer))

    def buffer_bytes(self, unit_params: float, *, param_bytes: float = 2,
                     grad_bytes: float = 2, dp_mode: str = "dp",
                     n_params: float | None = None, units: int | None = None,
                     tensor_params: float = 0.0) -> float:
        """Working-buffer bytes per rank beside the model states, for a largest unit of
        ``unit_params`` parameters among ``n_params`` (default: the unit's) that the rank
        reduces (a pipeline: its stage's, as its ``dp_mode`` lays them out). ``units``: how
        many units there are (None: many); one unit (a model without blocks: zero3 gathers
        it whole) has no next one gathered beside it. ``tensor_params``: the largest
        parameter tensor's elements: a tensor over the bucket cap is a bucket of its own, so
        a bucket (each of the ``buffer_buckets`` staging buffers) is up to that large."""
        if self.pipeline:
            return traits_of(dp_mode).buffer_bytes(unit_params, param_bytes=param_bytes,
                                                   grad_bytes=grad_bytes, n_params=n_params,
                                                   units=units, tensor_params=tensor_params)
        grads = (unit_params if n_params is None else n_params) * grad_bytes
        gathered = self.buffer_param_units if units is None else min(self.buffer_param_units,
                                                                     units)
        bucket = min(grads, max(BUCKET_BYTES, tensor_params * grad_bytes))
        return (unit_params * (gathered * param_bytes
                               + self.buffer_grad_units * grad_bytes)
                + self.buffer_buckets * bucket)


TRAITS: Mapping[str, Traits] = MappingProxyType({t.name: t for t in (
    Traits(name="dp", shards_params=False, shards_grads=False, shards_optimizer=False,
           replicas_survive_loss=True, lockstep_micro_batches=False),
    Traits(name="zero1", shards_params=False, shards_grads=False, shards_optimizer=True,
           replicas_survive_loss=False, lockstep_micro_batches=False, buffer_buckets=2),
    Traits(name="zero2", shards_params=False, shards_grads=True, shards_optimizer=True,
           replicas_survive_loss=False, lockstep_micro_batches=True, buffer_buckets=2),
    Traits(name="zero3", shards_params=True, shards_grads=True, shards_optimizer=True,
           replicas_survive_loss=False, lockstep_micro_batches=True, buffer_param_units=2,
           buffer_grad_units=1),
    Traits(name="pipeline", shards_params=True, shards_grads=True, shards_optimizer=True,
           replicas_survive_loss=True, lockstep_micro_batches=False, pipeline=True),
)})

# The layouts a pipeline can run inside each stage's data-parallel group.
DP_MODES: tuple[str, ...] = tuple(n for n, t in TRAITS.items() if not t.pipeline)
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")  # a pipeline's


def traits_of(name: str) -> Traits:
    """The traits of strategy ``name``. Raises ``StrategyError`` naming the known ones."""
    try:
        return TRAITS[name]
    except KeyError:
        raise StrategyError(
            f"unknown strategy {name!r}; choose one of {', '.join(TRAITS)}") from None


def spec_survives_loss(spec: Any) -> bool:
    """Whether a layout ``spec`` (a ``StrategySpec``: name, world_size, pp_degree, dp_mode)
    keeps a live holder of every entry after any one rank is lost (``Traits.survives_loss``
    with the spec's data-parallel degree: a pipeline's is world / pp)."""
    t = traits_of(spec.name)
    dp = spec.world_size // max(1, spec.pp_degree) if t.pipeline else spec.world_size
    return t.survives_loss(dp, spec.dp_mode)
