"""What the cost model needs to know about a model: sizes, work and activations per block.

A *block* is the unit a pipeline stage split counts (a transformer layer, an embedding, a
head). Work per block is given as forward+backward FLOPs per sample (turned into time with a
device's peak rate and an efficiency factor) and/or as measured seconds per sample on a given
device type or device id (which wins). Activation sizes are bytes per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ProfileError

__all__ = ["ModelProfile", "optimizer_state_bytes", "transformer_profile", "profile_from_dict"]


def optimizer_state_bytes(optimizer: str, mixed_precision: bool) -> int:
    """Optimizer state bytes per parameter (the ZeRO paper's K).

    Adam/AdamW: two fp32 moments = 8, plus an fp32 master copy under mixed precision = 12.
    SGD: nothing (4 for the master copy); SGD with momentum: 4 (8). Raises ``ProfileError``.
    """
    master = 4 if mixed_precision else 0
    table = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4, "sgd-momentum": 4}
    key = optimizer.lower()
    if key not in table:
        raise ProfileError(f"unknown optimizer {optimizer!r}; use one of {', '.join(table)}")
    return table[key] + master


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Sizes and work of a model, block by block. All tuples have one entry per block.

    ``block_params``: parameters per block. ``block_flops``: forward+backward FLOPs per sample.
    ``block_seconds``: measured forward+backward seconds per sample, keyed by device type name
    (``"A100-80GB"``) or device id (``"node-0/1"``); an id's figure already includes any
    emulation slowdown, a type's does not. ``boundary_bytes``: activation bytes per sample that
    block i hands to block i+1 (pipeline sends). ``activation_bytes``: bytes per sample block i
    keeps for its backward (default: ``boundary_bytes``, i.e. activation checkpointing per
    block). ``bytes_per_param`` / ``grad_bytes_per_param``: weight and gradient precision.
    ``optimizer_bytes_per_param``: the ZeRO paper's K (Adam with mixed precision: 12).
    ``block_tensors``: each block's parameter tensors (their element counts, in the model's
    order), which the layouts' message counts and ZeRO's ownership follow; without it a block
    counts as one tensor. ``frozen_params``: parameters per block that are not trained
    (held as weights only: no gradient, no optimizer state). Raises ``ProfileError`` on
    inconsistent input.
    """

    name: str = "model"
    block_params: tuple[int, ...]
    block_flops: tuple[float, ...] | None = None
    block_seconds: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    boundary_bytes: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    bytes_per_param: int = 2
    grad_bytes_per_param: int | None = None
    optimizer_bytes_per_param: int = 12
    precision: str = "bf16"
    block_tensors: tuple[tuple[int, ...], ...] | None = None
    frozen_params: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.block_params)
        if n == 0:
            raise ProfileError("block_params is empty; a model has at least one block")
        if any(p < 0 for p in self.block_params):
            raise ProfileError("block_params must be >= 0")
        for name in ("block_flops", "boundary_bytes", "activation_bytes", "frozen_params"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ProfileError(f"{name} has {len(v)} entries, block_params has {n}")
            if v is not None and any(x < 0 for x in v):
                raise ProfileError(f"{name} must be >= 0")
        for key, v in self.block_seconds.items():
            if len(v) != n:
                raise ProfileError(f"block_seconds[{key!r}] has {len(v)} entries, expected {n}")
        if self.block_tensors is not None:
            if len(self.block_tensors) != n:
                raise ProfileError(f"block_tensors has {len(self.block_tensors)} entries, "
                                   f"block_params has {n}")
            for i, (ts, p) in enumerate(zip(self.block_tensors, self.block_params, strict=True)):
                if sum(ts) != p or any(t < 0 for t in ts):
                    raise ProfileError(f"block_tensors[{i}] sums to {sum(ts)}, block_params[{i}]"
                                       f" is {p}; list each parameter tensor's element count")
        if self.bytes_per_param <= 0 or self.optimizer_bytes_per_param < 0:
            raise ProfileError("bytes_per_param must be > 0 and optimizer_bytes_per_param >= 0")

    @property
    def n_blocks(self) -> int:
        return len(self.block_params)

    @property
    def units(self) -> int:
        """Blocks with parameters: zero3's FSDP units (one for a model without blocks)."""
        return len(self.unit_params())

    def unit_params(self, blocks: Sequence[int] | None = None) -> tuple[int, ...]:
        """Parameters of each of zero3's FSDP units among ``blocks`` (default all): the
        blocks that have parameters, in order."""
        idx = range(self.n_blocks) if blocks is None else blocks
        return tuple(self.block_params[i] for i in idx if self.block_params[i] > 0)

    @property
    def n_params(self) -> int:
        return sum(self.block_params)

    def frozen(self, blocks: Sequence[int] | None = None) -> int:
        """Frozen parameters of ``blocks`` (default all)."""
        if self.frozen_params is None:
            return 0
        idx = range(self.n_blocks) if blocks is None else blocks
        return sum(self.frozen_params[i] for i in idx)

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes per parameter (defaults to the weight precision)."""
        return self.grad_bytes_per_param or self.bytes_per_param

    def tensors(self, blocks: Sequence[int] | None = None) -> tuple[int, ...]:
        """Element counts of the parameter tensors of ``blocks`` (default all), in order; a
        block without ``block_tensors`` counts as one tensor, and one with no parameters as
        none."""
        if self.block_tensors is None:
            return self.unit_params(blocks)
        idx = range(self.n_blocks) if blocks is None else blocks
        return tuple(t for i in idx for t in self.block_tensors[i])

    def biggest_tensor(self, blocks: Sequence[int] | None = None) -> int:
        """The largest parameter tensor's elements among ``blocks`` (default all), where
        ``block_tensors`` says; 0 without them (a block is not one tensor: a uniform
        profile's 50-billion-parameter block would count as one)."""
        if self.block_tensors is None:
            return 0
        return max(self.tensors(blocks), default=0)

    def boundary(self, i: int) -> float:
        return self.boundary_bytes[i] if self.boundary_bytes is not None else 0.0

    def stored(self, i: int) -> float:
        if self.activation_bytes is not None:
            return self.activation_bytes[i]
        return self.boundary(i)

    def with_optimizer(self, optimizer: str) -> ModelProfile:
        """A copy whose K follows ``optimizer`` (mixed precision when weights are < 4 bytes)."""
        from dataclasses import replace

        k = optimizer_state_bytes(optimizer, mixed_precision=self.bytes_per_param < 4)
        return replace(self, optimizer_bytes_per_param=k)

    @classmethod
    def uniform(
        cls,
        *,
        n_params: float,
        n_blocks: int,
        flops_per_sample: float = 0.0,
        boundary_bytes: float = 0.0,
        activation_bytes: float | None = None,
        **kw: Any,
    ) -> ModelProfile:
        """``n_blocks`` equal blocks sharing ``n_params`` and ``flops_per_sample`` (whole model).

        ``boundary_bytes`` and ``activation_bytes`` are per block (each block the same).
        """
        base, extra = divmod(int(n_params), n_blocks)
        params = tuple(base + (1 if i < extra else 0) for i in range(n_blocks))
        act = boundary_bytes if activation_bytes is None else activation_bytes
        return cls(
            block_params=params,
            block_flops=(flops_per_sample / n_blocks,) * n_blocks,
            boundary_bytes=(boundary_bytes,) * n_blocks,
            activation_bytes=(act,) * n_blocks,
            **kw,
        )


def transformer_profile(
    *,
    layers: int,
    d_model: int,
    n_heads: int,
    seq_len: int,
    vocab: int,
    precision: str = "bf16",
    optimizer: str = "adam",
    name: str = "transformer",
) -> ModelProfile:
    """A GPT-style decoder: embedding block, ``layers`` layer blocks, head block.

    Per layer 12 d^2 + 13 d parameters; forward+backward FLOPs per sample 6 x params x seq plus
    attention 12 s^2 d; activations kept for backward s d (34 + 5 a s / d) bytes in 16-bit
    (Korthikanti et al. 2022, no recomputation), doubled for fp32. Untied head.
    """
    if min(layers, d_model, n_heads, seq_len, vocab) <= 0:
        raise ProfileError("transformer_profile needs positive sizes")
    act_b = 4 if precision == "fp32" else 2
    s, d = seq_len, d_model
    layer_p = 12 * d * d + 13 * d
    emb_p, head_p = vocab * d + s * d, vocab * d + 2 * d
    params = (emb_p, *([layer_p] * layers), head_p)
    flops = (0.0, *([6.0 * layer_p * s + 12.0 * s * s * d] * layers), 6.0 * vocab * d * s)
    boundary = (s * d * act_b,) * (layers + 1) + (0.0,)
    layer_act = s * d * (34 + 5 * n_heads * s / d) * (act_b / 2)
    acts = (s * d * act_b, *([layer_act] * layers), s * vocab * (act_b + 4.0))
    k = optimizer_state_bytes(optimizer, mixed_precision=act_b < 4)
    return ModelProfile(
        name=name,
        block_params=params,
        block_flops=flops,
        boundary_bytes=boundary,
        activation_bytes=acts,
        bytes_per_param=act_b,
        optimizer_bytes_per_param=k,
        precision=precision,
    )


def profile_from_dict(d: Mapping[str, Any]) -> ModelProfile:
    """Build a profile from a dict: ``{"transformer": {...kwargs}}``, ``{"uniform": {...}}`` or
    the ``ModelProfile`` fields themselves (lists become tuples). Raises ``ProfileError``."""
    if "transformer" in d:
        return transformer_profile(**d["transformer"])
    if "uniform" in d:
        return ModelProfile.uniform(**d["uniform"])
    known = {f.name for f in fields(ModelProfile)}
    unknown = set(d) - known
    if unknown:
        raise ProfileError(f"unknown profile keys {sorted(unknown)}; known: {sorted(known)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k == "block_seconds":
            kw[k] = {str(dk): tuple(dv) for dk, dv in v.items()}
        elif k == "block_tensors":
            kw[k] = tuple(tuple(int(t) for t in ts) for ts in v)
        elif isinstance(v, Sequence) and not isinstance(v, str):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    return ModelProfile(**kw)
