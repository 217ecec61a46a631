"""The job's side of checkpoints: which store, which rank writes which pieces.

Every rank writes a shard; replicated entries are written once, by one of the ranks that hold
them (balanced by bytes). A layout in which no rank holds whole tensors (zero3) first gathers
the full state, then splits the writing the same way.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import CheckpointStore, Piece
from .config import JobConfig

__all__ = ["job_store", "checkpoint_pieces", "assign_writers"]


def job_store(cfg: JobConfig) -> CheckpointStore:
    """The job's checkpoint store: ``checkpoint_uri`` or ``<run dir>/checkpoints``."""
    uri = cfg.checkpoint_uri or os.path.join(cfg.run_path, "checkpoints")
    return CheckpointStore(uri, dict(cfg.checkpoint_options))


def assign_writers(holdings: list[dict[str, int]]) -> dict[str, int]:
    """key -> the rank that writes it: among the ranks holding a key, the least loaded so far
    (largest keys first; ties to the lowest rank). Same answer on every rank."""
    sizes: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    for r, held in enumerate(holdings):
        for k, n in held.items():
            sizes[k] = n
            holders.setdefault(k, []).append(r)
    load = [0] * len(holdings)
    owner: dict[str, int] = {}
    for k in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(holders[k], key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += sizes[k]
    return owner


def checkpoint_pieces(strategy: Any, held: dict[str, torch.Tensor], rank: int,
                      world: int) -> list[Piece]:
    """Collective. The pieces this rank writes for the current layout."""
    flag = torch.tensor([0.0 if held else 1.0])
    dist.all_reduce(flag, group=_cpu_group())
    if flag.item() > 0:  # some rank holds no whole tensor: gather the full state everywhere
        held = strategy.full_state()
    held = dict(held)
    held[f"rng/rank{rank}/torch"] = torch.get_rng_state()
    mine = {k: t.numel() * t.element_size() for k, t in held.items()}
    holdings: list[Any] = [None] * world
    dist.all_gather_object(holdings, mine, group=_cpu_group())
    owner = assign_writers(holdings)
    return [Piece(k, t) for k, t in held.items() if owner[k] == rank]


_GLOO: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A gloo group for small CPU-side agreements (NCCL wants device tensors)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO.clear()
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]
