"""Collective helpers shared by the sharded layouts (ZeRO, FSDP, pipelines).

Private to ``strategies``: the functions here know ``torch.distributed`` and the canonical state
format, nothing about any one strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .canonical import CanonicalState

__all__ = ["assign_owners", "gather_union", "global_ranks", "new_subgroups"]


def assign_owners(numels: Sequence[int], n: int) -> list[int]:
    """Deterministic greedy balance: the largest tensor first goes to the least loaded owner.

    Ties (equal sizes, equal loads) break by position and by owner index, so every rank that
    calls this with the same arguments gets the same answer. Returns ``owner[i]`` in ``0..n-1``.
    """
    loads = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        o = min(range(n), key=lambda r: (loads[r], r))
        owner[i] = o
        loads[o] += numels[i]
    return owner


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (``None`` is the default group), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def new_subgroups(rank_lists: Sequence[Sequence[int]]) -> list[dist.ProcessGroup | None]:
    """Collective over the default group: create one group per list, in order, on every rank.

    ``torch.distributed.new_group`` must be called by every rank for every group, in the same
    order; a list covering the whole world maps to ``None`` (the default group, not created,
    never destroyed). Returns the groups in the order given (non-members get a placeholder).
    """
    world = dist.get_world_size()
    timeout = group_timeout()
    out: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        if list(ranks) == list(range(world)):
            out.append(None)
        else:
            out.append(dist.new_group(ranks=list(ranks), timeout=timeout))
    return out


def group_timeout() -> timedelta | None:
    """The default group's timeout. ``new_group`` would otherwise give a sub-group the
    backend default (30 min for gloo): a rank blocked there on a failed peer would outwait
    the job's hang timeout by far."""
    pg = dist.distributed_c10d._get_default_group()
    for dev in pg._device_types:
        try:
            return pg._get_backend(dev).options._timeout
        except Exception:  # a backend without readable options: keep the default
            continue
    return None


def gather_union(
    partial: CanonicalState, device: torch.device, group: dist.ProcessGroup | None = None
) -> CanonicalState:
    """Collective over ``group``: every rank gets the union of all ranks' partial states.

    Each rank passes the canonical entries it holds in full. A key held by several ranks (a
    replica) must hold the same value there; it is sent once, from the lowest such rank.
    Metadata travels as one ``all_gather_object``; tensors travel as one flat broadcast per
    (source rank, dtype), on ``device`` (so NCCL works). Returns CPU tensors.
    """
    ranks = global_ranks(group)
    me = dist.get_rank()
    meta = {k: (tuple(v.shape), v.dtype) for k, v in partial.items()}
    metas: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * len(ranks)
    dist.all_gather_object(metas, meta, group=group)
    source: dict[str, int] = {}
    for i, m in enumerate(metas):
        assert m is not None
        for k in m:
            source.setdefault(k, i)
    out: CanonicalState = {}
    for i, src in enumerate(ranks):
        src_meta = metas[i]
        assert src_meta is not None
        keys = sorted(k for k, s in source.items() if s == i)
        for dtype in sorted({src_meta[k][1] for k in keys}, key=str):
            ks = [k for k in keys if src_meta[k][1] == dtype]
            sizes = [_numel(src_meta[k][0]) for k in ks]
            if src == me:
                flat = torch.cat([partial[k].detach().reshape(-1).to(device) for k in ks])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            if len(ranks) > 1:
                dist.broadcast(flat, src=src, group=group)
            for k, piece in zip(ks, torch.split(flat, sizes), strict=True):
                out[k] = piece.reshape(src_meta[k][0]).to("cpu", copy=True)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
