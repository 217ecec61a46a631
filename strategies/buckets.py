"""Bucketed gradient reduction of one data-parallel group (ZeRO-1/2 and the pipelines' dp).

Sending one message per parameter tensor costs one collective's latency per tensor (about
130 per step for a small MLP-Mixer, issue 16). As DDP's reducer and DeepSpeed's
``reduce_bucket_size`` do, parameters are grouped into buckets, and each bucket's gradients
travel as one flat buffer:

* **Buckets.** In reverse parameter order (the order backward produces gradients), one dtype
  per bucket, a new bucket when the next tensor would pass the cap (DDP's: 1 MiB for the
  first bucket, so that communication starts early, then 25 MiB). A tensor larger than the
  cap is a bucket of its own.
* **When.** From post-accumulate-grad hooks (``attach_hooks``): a bucket is launched once all
  its gradients are accumulated and every earlier bucket has been launched, so every rank
  launches the same collectives in the same order while backward goes on. ``flush`` launches
  whatever is left (a parameter that got no gradient, or no hooks at all) and waits.
* **What.** One asynchronous all-reduce per bucket in both modes. Mode ``all_reduce``: every
  rank keeps every summed gradient. Mode ``owned`` (ZeRO-2): the bucket is staged in a flat
  buffer, a rank drops the gradients it does not own at once (its copy is in the buffer) and
  keeps the sums of those it owns, as DeepSpeed's ZeRO-2 does with ``reduce_scatter: false``.
  Reductions are sums; the caller scales its loss.
* **The gradient norm for free.** Every rank receives every bucket's sums, so mode ``owned``
  also adds up the squared norm of the whole reduced gradient as the buckets finish
  (``last_sq``): the global norm needs no message of its own. One reduce per owner per
  bucket (the mode this replaced) sends fewer bytes, but n messages per bucket instead of
  one and a scalar all-reduce for the norm: on gloo with 2-3 ranks each message is a
  rendezvous, and zero2 measured 0.935x dp on TinyGPT that way (docs/benchmarks.md).

Every rank of the group must build it with the same parameters, owners and cap, and run the
same backward passes. Ownership: it owns its buffers (see ``GradBuckets``), allocated at a
bucket's first use and kept until ``close``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .base import grad_sq_sum
from .health import record as record_failure
from .traits import BUCKET_BYTES, FIRST_BUCKET_BYTES

__all__ = ["GradBuckets", "bucket_plan", "FIRST_BUCKET_BYTES", "BUCKET_BYTES"]


def bucket_plan(sizes: Sequence[tuple[int, torch.dtype]], cap: int = BUCKET_BYTES,
                first_cap: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Buckets of tensor indices: ``sizes[i]`` is (bytes, dtype) of tensor i; tensors are
    taken in reverse order, one dtype per bucket, a bucket closed when the next tensor would
    pass its cap (``first_cap`` for the first bucket, ``cap`` after). Pure: every rank gets
    the same plan from the same sizes."""
    out: list[list[int]] = []
    current: list[int] = []
    used, dtype = 0, None
    for i in reversed(range(len(sizes))):
        nbytes, dt = sizes[i]
        limit = first_cap if not out else cap
        if current and (dt != dtype or used + nbytes > limit):
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
        dtype = dt
    if current:
        out.append(current)
    return out


@dataclass
class _Bucket:
    params: list[int]  # indices, in the order their gradients sit in the flat buffer
    numel: int = 0
    dtype: torch.dtype = torch.float32
    waiting: int = 0  # gradients not accumulated yet in this backward
    works: list[dist.Work] = field(default_factory=list)
    flat: torch.Tensor | None = None  # in flight: the flat buffer being reduced
    staging: torch.Tensor | None = None  # mode owned: the staging buffer flat is cut from
    present: list[int] = field(default_factory=list)  # indices whose gradient is in flat


class GradBuckets:
    """Bucketed reduction of ``params``' gradients over ``group`` (see the module docstring).

    ``owner[i]``: the group index owning ``params[i]`` (mode ``owned``); ``ranks``: the
    group's global ranks, in group order; ``index``: this rank's group index.

    Buffers are allocated once and reused every step (a fresh large allocation costs page
    faults on every step: ~40 ms for 50 MB on the 2-core VM, as much as the copy itself).
    Mode ``all_reduce``: one buffer per bucket, and each gradient becomes a view of its
    bucket's buffer when the bucket is sent (copied in once, reduced in place, never copied
    back: what DDP's ``gradient_as_bucket_view`` does), so the buffers are the full gradients
    every rank holds anyway. Mode ``owned``: two staging buffers per dtype, each the size of
    the largest bucket, taken by the buckets in turn (a third bucket waits for the oldest one
    to finish), so gradients at rest stay the owned ones plus two buckets.
    """

    def __init__(self, params: Sequence[nn.Parameter], owner: Sequence[int], mode: str,
                 group: dist.ProcessGroup | None, ranks: Sequence[int], index: int,
                 cap: int = BUCKET_BYTES, first_cap: int = FIRST_BUCKET_BYTES,
                 label: str = "bucketed") -> None:
        if mode not in ("all_reduce", "owned"):
            raise ValueError(f"unknown reduction {mode!r}; use all_reduce or owned")
        self.params = list(params)
        self.owner = list(owner)
        self.mode = mode
        self.group = group
        self.ranks = list(ranks)
        self.index = index
        self.label = label  # names the layout in a recorded failure
        plan = bucket_plan([(p.numel() * p.element_size(), p.dtype) for p in self.params],
                           cap, first_cap)
        self.buckets = [_Bucket(b, sum(self.params[i].numel() for i in b),
                                self.params[b[0]].dtype) for b in plan]
        self._bucket_of = {i: k for k, b in enumerate(plan) for i in b}
        self._next = 0  # the next bucket to launch, in order
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # all_reduce: bucket -> (its buffer, the gradient views into it)
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}  # owned: free buffers
        self._staged: dict[torch.dtype, int] = {}  # owned: buffers allocated per dtype
        self._in_flight: list[_Bucket] = []  # launched, not finished, in launch order
        self.sync = True  # False: hooks let gradients accumulate (not the last micro-batch)
        self._device = self.params[0].device if self.params else torch.device("cpu")
        self._sq = torch.zeros((), dtype=torch.float64, device=self._device)
        # owned: the squared norm of the group's summed gradient after the last flush (None:
        # not known without a message, see flush)
        self.last_sq: torch.Tensor | None = None
        self._reset()

    # ------------------------------------------------------------------ hooks

    def attach_hooks(self) -> None:
        """Launch each bucket from the post-accumulate-grad hooks of its parameters."""
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            if not self.sync or len(self.ranks) == 1:
                return
            self.buckets[self._bucket_of[i]].waiting -= 1
            while (self._next < len(self.buckets)
                   and self.buckets[self._next].waiting == 0):
                self._launch(self._next)
                self._next += 1
            self._reap()

        return hook

    # ------------------------------------------------------------------ reduction

    def flush(self) -> None:
        """Launch every bucket not launched yet (in order, with the gradients present), then
        finish all of them: after it, gradients hold the group's sums (mode ``owned``: on
        their owners only; the other ranks hold none)."""
        self.last_sq = None
        if len(self.ranks) > 1:
            while self._next < len(self.buckets):
                self._launch(self._next)
                self._next += 1
            while self._in_flight:
                self._finish(self._in_flight[0])
            if self._unsure:  # gradients only other ranks had: kept where a mark says so
                got = torch.cat([m for _, _, m in self._unsure]).tolist()
                for (i, g, _), anywhere in zip(self._unsure, got, strict=True):
                    if anywhere > 0:
                        self.params[i].grad = g
            # every bucket went out whole (an owner's sum of an earlier micro-batch with it):
            # the sums' squares cover the whole gradient, alike on every rank
            if self.mode == "owned":
                self.last_sq = self._sq
        self._reset()

    def _launch(self, k: int) -> None:
        """Send bucket ``k``: every parameter at a fixed place in its buffer, a missing
        gradient's place zero, and after them one presence mark per parameter (1 where this
        rank has a gradient): every rank sends every bucket alike, whichever gradients it
        has (a parameter unused by one rank's samples, or summed on its owner by an earlier
        micro-batch), and the sums say which parameters got a gradient anywhere."""
        b = self.buckets[k]
        b.present = [i for i in b.params if self.params[i].grad is not None]
        with torch.no_grad():
            if self.mode == "all_reduce":
                b.flat = self._as_views(k, b)
            else:
                b.staging = self._take(b)
                b.flat = b.staging[:b.numel + len(b.params)]
                at = 0
                for i in b.params:
                    p = self.params[i]
                    n = p.numel()
                    if p.grad is None:
                        b.flat[at:at + n].zero_()
                    else:
                        b.flat[at:at + n].copy_(p.grad.reshape(-1))
                    at += n
            marks = b.flat[b.numel:]  # fill_ kernels on the device: no wait for it here
            marks.fill_(1.0)  # (``marks[j] = 0.0`` copies a CPU scalar: a sync on CUDA)
            for j, i in enumerate(b.params):
                if self.params[i].grad is None:
                    marks.narrow(0, j, 1).fill_(0.0)
            b.works.append(dist.all_reduce(b.flat, group=self.group, async_op=True))
        self._in_flight.append(b)
        if self.mode == "owned":
            for i in b.present:  # what is not ours is in the flat buffer now: drop it
                if self.owner[i] != self.index:
                    self.params[i].grad = None

    def _as_views(self, k: int, b: _Bucket) -> torch.Tensor:
        """Mode all_reduce: the bucket's buffer (its presence marks after the gradients),
        every present gradient a view of it (copied in unless it is one already); a missing
        gradient's place is zero (it stays None unless another rank had one)."""
        if k not in self._views:
            p0 = self.params[b.params[0]]
            buf = torch.zeros(b.numel + len(b.params), dtype=b.dtype, device=p0.device)
            views, at = [], 0
            for i in b.params:
                n = self.params[i].numel()
                views.append(buf[at:at + n].view_as(self.params[i]))
                at += n
            self._views[k] = (buf, views)
        flat, views = self._views[k]
        for i, view in zip(b.params, views, strict=True):
            p = self.params[i]
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
        return flat

    def _take(self, b: _Bucket) -> torch.Tensor:
        """Mode owned: a staging buffer for ``b`` (one of two per dtype, each the size of
        the largest bucket; when both are in flight, the oldest bucket is finished first)."""
        free = self._staging.setdefault(b.dtype, [])
        while not free and self._staged.get(b.dtype, 0) >= 2:
            self._finish(next(x for x in self._in_flight if x.dtype == b.dtype))
        if not free:
            size = max(x.numel + len(x.params) for x in self.buckets if x.dtype == b.dtype)
            p0 = self.params[b.params[0]]
            free.append(torch.empty(size, dtype=b.dtype, device=p0.device))
            self._staged[b.dtype] = self._staged.get(b.dtype, 0) + 1
        return free.pop()

    def _reap(self) -> None:
        """Finish the launched buckets whose reductions are complete (no waiting), so that
        their buffers are free again while backward goes on."""
        for b in list(self._in_flight):
            if all(w.is_completed() for w in b.works):
                self._finish(b)

    def _finish(self, b: _Bucket) -> None:
        for work in b.works:
            try:
                work.wait()
            except Exception as e:  # raised here, not in torch.distributed: say the group failed
                record_failure(f"{self.label} gradient reduction: {type(e).__name__}")
                raise
        self._in_flight.remove(b)
        flat, staging = b.flat, b.staging
        b.flat, b.staging, b.works = None, None, []
        if flat is None:
            return
        if staging is None and len(b.present) == len(b.params):
            return  # all_reduce, every gradient here: each a view of the sums already
        views = self._views[self.buckets.index(b)][1] if staging is None else []
        marks = flat[b.numel:]
        at = 0
        sums = []
        with torch.no_grad():
            for j, i in enumerate(b.params):
                p = self.params[i]
                n = p.numel()
                if staging is not None:
                    sums.append(flat[at:at + n])
                mine = staging is None or self.owner[i] == self.index
                if mine and p.grad is None:  # another rank may have had one: its mark says,
                    # read at the end of ``flush`` (one wait for all such, not one a bucket)
                    self._unsure.append((i, views[j] if staging is None else
                                         flat[at:at + n].view_as(p).clone(),
                                         marks[j:j + 1].clone()))
                elif staging is not None and mine:
                    g = p.grad
                    assert g is not None
                    g.copy_(flat[at:at + n].view_as(g))
                at += n
            if staging is not None:
                self._sq += grad_sq_sum(sums, self._sq.device)
        if staging is not None:
            self._staging[b.dtype].append(staging)

    def reset(self) -> None:
        """At a step's start: forget any bucket state of a backward that did not end in
        ``flush`` (a step that raised): nothing waits, and staging buffers go back to the
        pool."""
        for b in self._in_flight:
            if b.staging is not None:
                self._staging[b.dtype].append(b.staging)
        self.last_sq = None
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.waiting = len(b.params)
            b.works, b.flat, b.staging, b.present = [], None, None, []
        self._in_flight.clear()
        self._unsure: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # see _finish
        self._next = 0
        self._sq = torch.zeros((), dtype=torch.float64, device=self._device)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._reset()
        self._views.clear()
        self._staging.clear()
        self._staged.clear()
