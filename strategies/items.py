"""Losses that average over items of their own: the tokens of a batch that are not padding.

A loss is a mean over the samples of what it is given, and every layout weights each rank's
(and each micro-batch's) mean by its samples: the reduced gradient is then the mean over the
G samples of the step, whatever the split (``strategies.base``). A loss that averages over
*items* (a language model's targets with ``-100`` for padding: the built-in
``cross_entropy``) is not a mean over samples: one process's loss on the global batch is the
mean over every kept token of it, and a share's mean weighted by its samples is not its part
of that where shares hold different numbers of kept tokens per sample. Such a loss says how
many items a batch holds with a ``count_items(targets)`` attribute; the layouts then weight
each part's mean by its items over the global batch's (one scalar all-reduce a step: what
Hugging Face's ``num_items_in_batch`` does), so a run trains what one process trains, at
every world size and share split, and a resize or a node loss changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["counts_items", "item_count", "part_weights", "global_items", "per_item"]


def counts_items(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` averages over items it counts (``count_items``)."""
    return callable(getattr(loss_fn, "count_items", None))


def item_count(loss_fn: Callable[..., Any], targets: torch.Tensor) -> torch.Tensor:
    """The items of ``targets`` as ``loss_fn`` counts them, a float64 scalar on their device
    (no host sync)."""
    n = loss_fn.count_items(targets)  # type: ignore[attr-defined]
    return torch.as_tensor(n, device=targets.device).to(torch.float64).reshape(())


def global_items(local: torch.Tensor, device: torch.device | str,
                 group: Any = None) -> torch.Tensor:
    """Collective over ``group`` (default: the world): the sum of every member's ``local``
    count, at least 1 (a global batch of padding only scores 0 with zero gradients)."""
    total = local.to(device).clone()
    dist.all_reduce(total, group=group)
    return total.clamp(min=1.0)


def part_weights(loss_fn: Callable[..., Any], targets: torch.Tensor,
                 parts: Sequence[tuple[int, int]], share: int, global_batch: int,
                 device: torch.device | str) -> list[float]:
    """Each micro-batch's weight on this rank's share (``parts``: its row ranges): its
    samples over the share's, or, for a loss that counts items, its items over the global
    batch's times ``G / share`` (collective: every rank calls it once a step), so that a
    layout's ``share / G`` scale turns either into the part's fraction of the global mean."""
    if not counts_items(loss_fn):
        return [(b - a) / len(targets) for a, b in parts]
    counts = torch.stack([item_count(loss_fn, targets[a:b]) for a, b in parts])
    return (counts / global_items(counts.sum(), device) * (global_batch / share)).tolist()


def per_item(loss_fn: Callable[..., Any], targets: torch.Tensor, device: torch.device | str,
             group: Any, factor: float) -> torch.Tensor | None:
    """A pipeline's weight per item of a micro-batch's mean: ``factor`` over the global
    batch's items (``targets``: a replica's whole batch, summed over the replicas of
    ``group``, one scalar all-reduce; None: one replica). None for a loss that does not
    count items (its micro-batches are weighted by samples)."""
    if not counts_items(loss_fn):
        return None
    k = item_count(loss_fn, targets)
    total = global_items(k, device, group) if group is not None else k.clamp(min=1.0)
    return factor / total
