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

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RunningStats", "batch_counters", "running_stats"]


def running_stats(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The floating running statistics (mean, variance) of ``modules``' normalisation layers
    that track them, in module order (the same on every rank of a layout)."""
    return [b for m in _norms(modules) for b in (m.running_mean, m.running_var)
            if b is not None and b.is_floating_point()]


def batch_counters(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Those layers' ``num_batches_tracked`` counters (with ``momentum=None`` they weight
    the cumulative average), in module order."""
    return [m.num_batches_tracked for m in _norms(modules)
            if m.num_batches_tracked is not None]


def _norms(modules: Iterable[nn.Module]) -> list[nn.modules.batchnorm._NormBase]:
    return [m for module in modules for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


class RunningStats:
    """A layout's running statistics (``running_stats``), their counters
    (``batch_counters``) and their last finite values.

    ``average`` replaces the statistics with their average over ``group``, this rank's
    weighted by ``weight`` (the weights of the group's ranks sum to 1): one all-reduce of them
    flattened, in fp32, collective over ``group`` when there are statistics (the same on
    every rank). Where the average is not finite (a NaN or inf in some replica's samples,
    a step the layouts then skip), every replica keeps the last finite values instead, and
    the counters go back to the step's start: NaN statistics would stay NaN for the rest of
    the job, and no checkpoint holding them would ever be committed. ``hold`` before a
    step's forwards keeps the values there (and, at a layout's first step, the finite ones
    to fall back to); ``rewind`` puts them back after a step that raised (a peer lost inside
    it: the step is run again from the state before it), ``redo`` undoes that where the
    step's update is applied after all (a pipeline's pending update)."""

    def __init__(self, tensors: list[torch.Tensor], counters: Sequence[torch.Tensor] = ()
                 ) -> None:
        self.tensors = tensors
        self.counters = list(counters)
        self._good: torch.Tensor | None = None
        self._start: list[torch.Tensor] | None = None  # the values at the step's start
        self._undone: list[torch.Tensor] | None = None  # what ``rewind`` replaced

    def _all(self) -> list[torch.Tensor]:
        return self.tensors + self.counters

    def hold(self) -> None:
        """Before a step's forwards: keep the values there; and the finite ones to fall back
        to, if none are kept yet (a layout's first step; later ones keep each finite
        average)."""
        if self._all():
            self._start = [t.detach().clone() for t in self._all()]
            self._undone = None
        if self._good is None and self.tensors:
            flat = torch.cat([s.detach().reshape(-1).float() for s in self.tensors])
            if bool(torch.isfinite(flat).all()):
                self._good = flat

    def finished(self) -> None:
        """The step completed: its start's values are nothing to go back to (a later step
        that raises before its ``hold`` has none)."""
        self._start = self._undone = None

    def rewind(self) -> None:
        """After a step that raised: the statistics and counters as they were at its start
        (its forwards had moved them; the state it is run again from has not)."""
        if self._start is None:
            return
        self._undone = [t.detach().clone() for t in self._all()]
        _put(self._all(), self._start)

    def redo(self) -> None:
        """Undo ``rewind``: the step's update is applied after all."""
        if self._undone is not None:
            _put(self._all(), self._undone)
            self._undone = None

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
            if self._start is not None and self.counters:  # the skipped step counts none
                _put(self.counters, self._start[len(self.tensors):])
            if self._good is None:
                return
            flat = self._good
        else:
            self._good = flat
        at = 0
        for s in self.tensors:
            s.detach().copy_(flat[at:at + s.numel()].view_as(s))
            at += s.numel()


def _put(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values, strict=True):
            t.copy_(v)
