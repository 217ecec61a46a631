"""Normalisation layers' running statistics, kept equal over a layout's replicas.

A BatchNorm layer (an InstanceNorm that tracks running statistics too) updates its running
mean and variance from its own rank's samples at every training forward, so replicas drift
apart: a checkpoint then holds whichever rank's wrote it, and ranks score an evaluation
differently. DDP's default broadcasts rank 0's buffers before each forward (rank 0's samples
only); elastic's layouts leave that off and average the statistics over the replicas after
each step instead, each replica weighted by its part of the global batch. The running mean is
then the one a single process would have over the global batch (the exponential average is
linear in the batch means); the running variance is the replicas' within-sample variances
averaged, without the spread between replicas' means. A forward still normalises by its own
samples' statistics, as under DDP (``nn.SyncBatchNorm`` normalises by the global batch's).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RunningStats", "running_stats"]


def running_stats(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The floating running statistics (mean, variance) of ``modules``' normalisation layers
    that track them, in module order (the same on every rank of a layout)."""
    out: list[torch.Tensor] = []
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                out += [b for b in (m.running_mean, m.running_var)
                        if b is not None and b.is_floating_point()]
    return out


class RunningStats:
    """A layout's running statistics (``running_stats``) and their last finite values.

    ``average`` replaces them with their average over ``group``, this rank's weighted by
    ``weight`` (the weights of the group's ranks sum to 1): one all-reduce of them
    flattened, in fp32, collective over ``group`` when there are statistics (the same on
    every rank). Where the average is not finite (a NaN or inf in some replica's samples,
    a step the layouts then skip), every replica keeps the last finite values instead: NaN
    statistics would stay NaN for the rest of the job, and no checkpoint holding them would
    ever be committed. ``hold`` before a layout's first step's forwards takes the values
    to fall back to there."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self._good: torch.Tensor | None = None

    def hold(self) -> None:
        """Before a step's forwards: keep the current values to fall back to, if none are
        kept yet (a layout's first step; later ones keep each finite average)."""
        if self._good is None and self.tensors:
            flat = torch.cat([s.detach().reshape(-1).float() for s in self.tensors])
            if bool(torch.isfinite(flat).all()):
                self._good = flat

    def average(self, weight: float, group: dist.ProcessGroup | None = None,
                alone: bool = False) -> None:
        """``alone``: this rank is its statistics' only holder (a pipeline stage at dp 1):
        no all-reduce, the finite check only."""
        if not self.tensors:
            return
        flat = torch.cat([s.detach().reshape(-1).float() for s in self.tensors])
        if not alone and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat.mul_(weight), group=group)
        if not bool(torch.isfinite(flat).all()):
            if self._good is None:
                return
            flat = self._good
        else:
            self._good = flat
        at = 0
        for s in self.tensors:
            s.detach().copy_(flat[at:at + s.numel()].view_as(s))
            at += s.numel()
