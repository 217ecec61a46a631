"""The pipeline-ready ("blocks") protocol: how a model names the blocks it is made of.

A model is pipeline-ready if it is either

* an ``nn.Sequential`` (its children are the blocks), or
* any module with a method ``pipeline_blocks() -> list[tuple[str, nn.Module]]`` returning its
  blocks in order: each name is the block's FQN in the model (dotted names such as
  ``"layers.0"`` are fine), and ``forward(x)`` must equal applying the blocks one after the
  other to a single tensor ``x``; the last block's output goes to ``loss_fn``.

Every parameter and buffer must belong to exactly one block (no tied weights across blocks,
nothing outside the blocks); anything else is a ``StrategyError`` naming the culprit.

Blocks are what pipeline stages are cut from, what ZeRO-3 wraps as FSDP units, what
activation checkpointing recomputes, and what the planner profiles and costs (one
implementation for all of them, here).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import StrategyError

__all__ = [
    "pipeline_blocks",
    "pipeline_blocks_or_none",
    "blocks_of",
    "block_params",
    "checkpoint_blocks",
    "checkpointable",
]


def pipeline_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's ordered ``(fqn, block)`` list (see the module docstring).

    Raises ``StrategyError`` if the model is not pipeline-ready, naming why.
    """
    kind = type(model).__name__
    protocol = getattr(model, "pipeline_blocks", None)
    if callable(protocol):
        blocks = [(str(n), m) for n, m in protocol()]
    elif isinstance(model, nn.Sequential):
        blocks = list(model.named_children())
    else:
        raise StrategyError(
            f"{kind} cannot be pipelined: it is neither an nn.Sequential nor has a "
            "pipeline_blocks() method; add pipeline_blocks() returning the ordered "
            "(name, module) blocks whose composition is forward()"
        )
    if not blocks:
        raise StrategyError(f"{kind} cannot be pipelined: it has no blocks")
    names = [n for n, _ in blocks]
    if len(set(names)) != len(names):
        raise StrategyError(f"{kind}.pipeline_blocks() names a block twice: {names}")
    for name, block in blocks:
        try:
            found = model.get_submodule(name)
        except AttributeError:
            found = None
        if found is not block:
            raise StrategyError(
                f"{kind}.pipeline_blocks(): {name!r} is not the FQN of that block in the model; "
                "return the blocks under their names in the model"
            )
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise StrategyError(f"{kind}: block {b!r} is nested inside block {a!r}")
    owner: dict[int, str] = {}
    for name, block in blocks:
        for t in [*block.parameters(), *block.buffers()]:
            if id(t) in owner:
                raise StrategyError(
                    f"{kind}: blocks {owner[id(t)]!r} and {name!r} share a tensor (tied "
                    "weights); untie them or keep them in one block"
                )
            owner[id(t)] = name
    outside = [
        fqn
        for fqn, _ in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        if not any(fqn.startswith(n + ".") for n in names)
    ]
    if outside:
        raise StrategyError(
            f"{kind} cannot be pipelined: {outside[:5]} belong to no pipeline block; "
            "move them into a block"
        )
    return blocks


def pipeline_blocks_or_none(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """Like ``pipeline_blocks`` but ``None`` for a model that is not pipeline-ready."""
    try:
        return pipeline_blocks(model)
    except StrategyError:
        return None


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The units a model's work is measured and costed in: its pipeline blocks, or the whole
    model as one block when it is not pipeline-ready."""
    blocks = pipeline_blocks_or_none(model)
    return [m for _, m in blocks] if blocks else [model]


def block_params(model: nn.Module) -> list[int]:
    """Parameters per block of ``blocks_of(model)``."""
    return [sum(p.numel() for p in b.parameters()) for b in blocks_of(model)]


def checkpointable(model: nn.Module) -> str | None:
    """Why activation checkpointing cannot run on ``model`` (``pipeline_blocks``'s refusal:
    no blocks, a tensor shared across blocks, ...), or None when it can."""
    try:
        pipeline_blocks(model)
    except StrategyError as e:
        return str(e)
    return None


@contextlib.contextmanager
def buffers_kept(module: nn.Module, stats_only: bool = False) -> Iterator[None]:
    """``module``'s buffers (``stats_only``: those of its normalisation layers that keep
    running statistics) as they were before, after the block: a forward run again (a
    recompute) must not update BatchNorm's running statistics a second time."""
    mods = [m for m in module.modules() if not stats_only or (
        isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats)]
    saved = [(b, b.detach().clone()) for m in mods for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        for b, v in saved:  # through .data: the backward inference that follows holds the
            b.data.copy_(v)  # forward's graph, which checks the buffers' version counters


def _recompute_keeps_buffers(block: nn.Module) -> tuple[Any, Any]:
    """The recompute's contexts: its normalisation layers' running statistics put back
    after it (only theirs: cloning every buffer would copy a causal mask at each recompute)."""
    return contextlib.nullcontext(), buffers_kept(block, stats_only=True)


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing: each block of a pipeline-ready model keeps only its input
    for backward and recomputes the rest (``torch.utils.checkpoint``, non-reentrant, RNG
    state preserved, so dropout recomputes the same mask; its buffers put back after the
    recompute, so BatchNorm's running statistics are updated once). The block's ``forward`` is
    replaced on the instance, so parameter names stay those of the model (a
    ``checkpoint_wrapper`` would add a prefix) and hooks of DDP and FSDP2 stay on the block.
    Returns the number of blocks; raises ``StrategyError`` for a model without blocks."""
    from torch.utils.checkpoint import checkpoint

    try:
        blocks = pipeline_blocks(model)
    except StrategyError as e:
        raise StrategyError(f"activation checkpointing works block by block: {e}") from None
    for _, blk in blocks:
        inner = blk.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, block: nn.Module = blk,
                    **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing to save: no recompute either
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=functools.partial(
                _recompute_keeps_buffers, block), **kwargs)

        blk.forward = forward  # type: ignore[method-assign]
    return len(blocks)
