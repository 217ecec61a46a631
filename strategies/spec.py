"""What a layout is asked to be: ``StrategySpec`` with typed options and named degrees.

Torch-free (the controller and the planner build and check specs without torch). A spec is
checked in one place, ``StrategySpec.validate``: one share per rank, every share at least one
sample, the named parallel degrees (``Degrees``) multiplying to the world size, and the
micro-batch count of the layouts whose every micro-batch is a collective. What needs the model
(its blocks, a pipeline's stage split) is checked by the strategy's own ``validate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import StrategyError
from .traits import Traits, traits_of

__all__ = [
    "PRECISIONS",
    "StrategyOptions",
    "Degrees",
    "StrategySpec",
    "micro_batch_count",
    "lockstep_micro_batches",
    "rank_micro_batches",
    "eval_passes",
    "pipeline_defaults",
]

PRECISIONS = ("fp32", "bf16")

_POSITIVE_INTS = ("micro_batch_size", "accumulation_steps", "virtual_stages", "dp_degree")
_FLAGS = ("activation_checkpointing", "init_sync", "bucket_view", "reshard_after_forward",
          "find_unused_parameters")


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """Settings every layout applies itself (the job's, the planner's, the worker's).

    ``max_grad_norm``: clip the global gradient norm to it (None: no clipping).
    ``precision``: ``fp32``, or ``bf16`` (forward and loss under ``torch.autocast``; weights,
    gradients and optimizer state stay fp32). ``micro_batch_size``: at most that many samples
    per forward+backward pass (gradient accumulation; None: one pass per share).
    ``accumulation_steps``: at least that many passes per step (the planner's, when activations
    do not fit). ``activation_checkpointing``: every block recomputes its activations in
    backward. ``init_sync``: DDP broadcasts the parameters at construction (False when a full
    state is loaded right after). ``bucket_view``: DDP's ``gradient_as_bucket_view``.
    ``reshard_after_forward``: FSDP frees gathered parameters after each unit's forward.
    ``find_unused_parameters``: DDP's (dp): each step looks for parameters the forward left
    out (a model whose forward skips some); zero3 then drops the gradients no rank made (it
    reduce-scatters zeros where a rank left a parameter out whatever the option); zero1 and
    zero2 take such models as they are.
    ``virtual_stages``: stages per rank of an interleaved pipeline (the planner's; the schedule
    runs 2). ``dp_degree``: a data-parallel degree the caller expects (checked against the
    world size by ``Degrees.of``; None: derived).

    Construct with keywords, or from a mapping with ``StrategyOptions.of`` (an unknown key is
    a ``StrategyError`` that names it). Values are checked at construction.
    """

    max_grad_norm: float | None = None
    precision: str = "fp32"
    micro_batch_size: int | None = None
    accumulation_steps: int = 1
    activation_checkpointing: bool = False
    init_sync: bool = True
    bucket_view: bool = True
    reshard_after_forward: bool = True
    find_unused_parameters: bool = False
    virtual_stages: int = 1
    dp_degree: int | None = None

    def __post_init__(self) -> None:
        clip = self.max_grad_norm
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
                raise StrategyError(f"option max_grad_norm must be a positive number, got "
                                    f"{clip!r}; leave it out to disable clipping")
            object.__setattr__(self, "max_grad_norm", float(clip))
        if self.precision not in PRECISIONS:
            raise StrategyError(f"unknown precision {self.precision!r}; use one of "
                                f"{', '.join(PRECISIONS)}")
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            if v is None and name in ("micro_batch_size", "dp_degree"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise StrategyError(f"option {name} must be a positive integer, got {v!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"option {name} must be true or false, got "
                                    f"{getattr(self, name)!r}")

    @classmethod
    def of(cls, value: StrategyOptions | Mapping[str, Any] | None) -> StrategyOptions:
        """``value`` as options: options as they are, a mapping by its keys, None: defaults.
        Raises ``StrategyError`` naming an unknown key and the known ones."""
        if value is None:
            return cls()
        if isinstance(value, StrategyOptions):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise StrategyError(f"unknown strategy option {unknown[0]!r}; known options: "
                                f"{', '.join(sorted(known))}")
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from their defaults, by name (JSON-able)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def over(self, base: StrategyOptions | Mapping[str, Any] | None) -> StrategyOptions:
        """These options on top of ``base``: every option set here (differing from its
        default) wins; the others come from ``base``."""
        return dataclasses.replace(StrategyOptions.of(base), **self.to_dict())


@dataclass(frozen=True)
class Degrees:
    """The named parallel degrees of a layout: ``dp`` data-parallel ranks (ZeRO shards over
    them), ``pp`` pipeline stages, ``tp`` tensor-parallel ranks (1: no layout splits a layer
    yet). Ranks are pp-major: ``rank = stage * dp + replica`` (tp would be innermost)."""

    dp: int
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @classmethod
    def of(cls, spec: StrategySpec) -> Degrees:
        """The degrees of ``spec``: the one place where their product is checked against the
        world size. A layout that is not a pipeline ignores ``pp_degree`` (dp = world size).
        Raises ``StrategyError`` naming the fix."""
        world = spec.world_size
        pp = spec.pp_degree if spec.traits.pipeline else 1
        if pp < 1:
            raise StrategyError(f"pp_degree must be >= 1, got {pp}")
        if world % pp:
            raise StrategyError(
                f"pp_degree {pp} x dp degree must equal the world size {world}: "
                f"choose a pp_degree that divides {world}")
        out = cls(dp=world // pp, pp=pp)
        want = spec.options.dp_degree
        if want is not None and want * out.pp * out.tp != world:
            raise StrategyError(
                f"pp_degree {pp} x dp_degree {want} = {pp * want}, not the world size {world}")
        return out


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy needs to lay itself out. Built by the controller from a plan.

    ``shares[r]`` is rank r's number of samples of the global batch (sum = global batch).
    Pipeline fields (``pp_degree``, ``micro_batches``, ``schedule``, ``stage_split``,
    ``dp_mode``) are ignored by layouts that are not pipelines. ``options`` may be given as a
    mapping; it is converted to ``StrategyOptions`` (an unknown key raises ``StrategyError``).
    """

    name: str
    world_size: int
    shares: tuple[int, ...]
    pp_degree: int = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    stage_split: tuple[int, ...] | None = None
    dp_mode: str = "dp"  # inner data-parallel flavour of a hybrid (dp or zero1/2/3)
    options: StrategyOptions = field(default_factory=StrategyOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shares", tuple(self.shares))
        if self.stage_split is not None:
            object.__setattr__(self, "stage_split", tuple(self.stage_split))
        if not isinstance(self.options, StrategyOptions):
            object.__setattr__(self, "options", StrategyOptions.of(self.options))

    @property
    def global_batch_size(self) -> int:
        return sum(self.shares)

    @property
    def traits(self) -> Traits:
        """This strategy's traits (``StrategyError`` for an unknown name)."""
        return traits_of(self.name)

    @property
    def degrees(self) -> Degrees:
        """The named parallel degrees (``Degrees.of``: raises ``StrategyError`` when their
        product is not the world size)."""
        return Degrees.of(self)

    def validate(self) -> None:
        """Raise ``StrategyError`` if no layout could run this spec (see the module
        docstring); what depends on the model is the strategy's ``validate``."""
        if len(self.shares) != self.world_size:
            raise StrategyError(
                f"{len(self.shares)} batch shares for {self.world_size} workers; "
                "give one share per worker")
        if any(s < 1 for s in self.shares):
            raise StrategyError(
                f"every worker needs at least one sample per step, shares are "
                f"{list(self.shares)}; raise global_batch_size or use fewer workers")
        _ = self.degrees
        if self.traits.lockstep_micro_batches:
            lockstep_micro_batches(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: tuples as lists, options as ``StrategyOptions.to_dict``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = (v.to_dict() if isinstance(v, StrategyOptions)
                           else list(v) if isinstance(v, tuple) else v)
        return out


def micro_batch_count(spec: StrategySpec, n: int) -> int:
    """How many micro-batches (gradient accumulation passes) a dp or ZeRO rank runs its
    ``n`` samples in: at least ``accumulation_steps`` (the planner's, when activations do not
    fit), enough for at most ``micro_batch_size`` samples each (the job's), never more than
    ``n``."""
    k = spec.options.accumulation_steps
    cap = spec.options.micro_batch_size
    if cap:
        k = max(k, -(-n // cap))
    return max(1, min(k, n))


def lockstep_micro_batches(spec: StrategySpec) -> int:
    """The micro-batch count of a layout whose every micro-batch is a collective on every
    rank (``Traits.lockstep_micro_batches``): the largest share's, on every rank. Raises
    ``StrategyError`` when a share cannot fill it."""
    k = micro_batch_count(spec, max(spec.shares))
    if k > min(spec.shares):
        raise StrategyError(
            f"micro_batch_size {spec.options.micro_batch_size} makes {k} micro-batches "
            f"per step, and under {spec.name} every rank runs as many, but the smallest share "
            f"is {min(spec.shares)} samples; raise micro_batch_size to at least "
            f"{-(-max(spec.shares) // min(spec.shares))}")
    return k


def eval_passes(spec: StrategySpec, parts: Sequence[int]) -> int:
    """How many forwards an evaluation runs each rank's part in (``parts``: every rank's
    samples of the evaluation batch; every rank runs as many, since a zero3 forward is a
    collective): no rank's forward holds more samples than its own training micro-batches
    do, so evaluation needs no more activation memory than a training step on any device
    (``micro_batch_size``, the planner's per-device accumulation; without gradients a
    forward keeps less)."""
    need = 1
    for part, share in zip(parts, spec.shares, strict=True):
        need = max(need, -(-part // -(-share // rank_micro_batches(spec, share))))
    return need


def rank_micro_batches(spec: StrategySpec, share: int) -> int:
    """The micro-batches a dp or ZeRO rank of ``share`` samples runs a step in: the lockstep
    count where every micro-batch is a collective, else its own."""
    if spec.traits.lockstep_micro_batches:
        return lockstep_micro_batches(spec)
    return micro_batch_count(spec, share)


def pipeline_defaults(batches: Sequence[int], pp: int, micro_batches: int | None = None,
                      schedule: str | None = None, micro_batch_size: int | None = None
                      ) -> tuple[int, str]:
    """The micro-batch count and schedule of a pipeline whose job leaves either out (None),
    for replica batches ``batches`` on ``pp`` stages. Unset, the schedule is 1F1B (torchtitan's
    default: GPipe's bubble, with at most ``pp`` micro-batches' activations held instead of
    all) and the count is the one that divides every replica's batch nearest ``2 pp`` within
    ``[pp, 4 pp]`` (a bubble of (pp-1)/(m+pp-1): 20-33 % at 2 pp; each micro-batch adds a
    fixed cost, which on a small batch outgrows the bubble it saves: ``docs/benchmarks.md`` at 2d38cfc, Planner, sessions 30 and 32),
    leaving two samples or more per micro-batch where any count can (BatchNorm needs two; a
    one-sample micro-batch starves a GPU). The job's ``micro_batch_size`` caps the samples
    per micro-batch: the count is then at least ``max(batches) / micro_batch_size``. Where no
    count in range divides the batches, the largest count up to ``4 pp`` that does, under
    GPipe when it is below ``pp`` (1 at worst: the stages take turns). A given value is kept: a given count runs 1F1B from
    ``pp`` up, GPipe below; a given schedule gets the count it needs, or ``pp`` when none
    divides (``Pipeline.validate`` then says why)."""
    if micro_batches is not None:
        return micro_batches, schedule or ("1f1b" if micro_batches >= pp else "gpipe")
    if not batches or min(batches) < 1:  # an empty replica: validate says so
        return 1, schedule or "gpipe"
    g = math.gcd(*batches)
    least = -(-max(batches) // micro_batch_size) if micro_batch_size else 1
    top = max(4 * pp, 2 * least)
    divisors = [m for m in range(1, g + 1) if g % m == 0]
    step = pp if schedule == "interleaved" else 1  # interleaved: a multiple of pp
    fits = [m for m in divisors if m >= max(pp, least) and m % step == 0]
    near = [m for m in ([m for m in fits if min(batches) // m >= 2] or fits) if m <= top]
    if near:
        return min(near, key=lambda m: (abs(m - max(2 * pp, least)), m)), schedule or "1f1b"
    if schedule in (None, "gpipe"):
        within = [m for m in divisors if least <= m <= top]
        m = max(within) if within else min((m for m in divisors if m >= least), default=g)
        return m, schedule or ("1f1b" if m >= pp else "gpipe")
    return (min(fits) if fits else max(pp, least)), schedule
