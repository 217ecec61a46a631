"""The job's side of checkpoints: which store, which rank writes which pieces.

Every rank writes a shard of what it holds; replicated entries are written once, by one of the
ranks that hold them (balanced by bytes); sharded entries (zero3) are written as each rank's
rows, with no gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import CheckpointStore, Piece
from .config import JobConfig, WorkerConfig

__all__ = ["job_store", "checkpoint_pieces", "assign_writers"]


def job_store(cfg: JobConfig | WorkerConfig) -> CheckpointStore:
    """The job's checkpoint store (``checkpoint_uri`` or ``<run dir>/checkpoints``), over the
    location the config parsed once: building a store here parses nothing."""
    location = cfg.checkpoint_location
    if location is None:
        raise ValueError("this worker's job writes no checkpoints; there is no store")
    return CheckpointStore(location)


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


def checkpoint_pieces(strategy: Any, rank: int, world: int) -> list[Piece]:
    """Collective. The pieces this rank writes for the current layout: what it holds itself
    (``Strategy.local_state``: whole entries, or its rows of sharded ones, so no layout
    gathers), each written once: a piece several ranks hold alike (a replica) by the least
    loaded of them. The tensors are the live ones where the layout allows (no copy here;
    ``ShardWriter.begin`` copies)."""
    local = strategy.local_state()
    rows = strategy.local_rows()
    ids: dict[str, tuple[str, torch.Tensor, int, tuple[int, ...] | None]] = {}
    for k, t in local.items():
        shape, r = rows.get(k, (tuple(t.shape), None))
        if r is None:
            ids[k] = (k, t, 0, None)
        else:
            ids[f"{k}@{r[0]}:{r[1]}"] = (k, t, int(r[0]), tuple(shape))
    rng = f"rng/rank{rank}/torch"
    ids[rng] = (rng, torch.get_rng_state(), 0, None)
    mine = {i: v[1].numel() * v[1].element_size() for i, v in ids.items()}
    holdings: list[Any] = [None] * world
    dist.all_gather_object(holdings, mine, group=_cpu_group())
    owner = assign_writers(holdings)
    return [Piece(k, t, start=a, full_shape=full) for i, (k, t, a, full) in ids.items()
            if owner[i] == rank]


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
