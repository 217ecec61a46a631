"""The per-block hooks that time (and, for emulated devices, slow) a rank's compute, shared by
the step loop (``elastic.worker.profiling``) and the profiler's measurements
(``elastic.worker.measure``, ``elastic.worker.trial``).

``SpanHooks`` wraps every compute block of a layout: it sums the seconds spent inside the
blocks' forwards (this rank's own compute, without the collectives between blocks, which the
controller's closed loop reads per rank) and, on an emulated slower device, sleeps ``(slowdown
- 1) x`` each forward's and each backward's time where it happens.

On a CUDA device a forward's host time is the time to launch its kernels, not to run them:
there each span is timed by a pair of CUDA events on the current stream, read when the step's
figure is taken (``take``, after the step's loss came back to the host, so the events have
completed). No synchronization per block; the emulated slowdown, which must sleep the time a
block ran, synchronizes as before.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["SpanHooks", "sync_fn", "median"]


def sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


class SpanHooks:
    """Forward (and, when slowed, backward) hooks on a layout's compute blocks.

    ``take()`` returns the seconds spent inside the blocks' forwards since the last call
    (emulated sleep included). Not thread-safe: the step loop owns it."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._fwd = 0.0
        self._spans: list[tuple[Any, Any]] = []  # CUDA: (start, end) events not yet read
        self._free: list[Any] = []  # CUDA events read, for reuse

    def install(self, blocks: Sequence[nn.Module], slowdown: float, device: torch.device,
                time_forward: bool = True) -> None:
        """(Re)install on ``blocks`` (no reference to them is kept beyond the hooks)."""
        self.remove()
        extra = max(0.0, slowdown - 1.0)
        if extra <= 0 and not time_forward:
            return
        if device.type == "cuda" and extra <= 0:
            self._install_events(blocks, device)
            return
        sync = sync_fn(device)
        started: dict[tuple[int, str], float] = {}

        def start(phase: str) -> Callable[..., None]:
            def hook(mod: Any, *_args: Any) -> None:
                if extra > 0:
                    sync()
                started[(id(mod), phase)] = time.perf_counter()
            return hook

        def stop(phase: str) -> Callable[..., None]:
            def hook(mod: Any, *_args: Any) -> None:
                t = started.pop((id(mod), phase), None)
                if t is None:
                    return
                if extra > 0:
                    sync()
                    time.sleep(extra * (time.perf_counter() - t))
                if phase == "fwd":
                    self._fwd += time.perf_counter() - t
            return hook

        for m in blocks:
            self._handles += [m.register_forward_pre_hook(start("fwd")),
                              m.register_forward_hook(stop("fwd"))]
            if extra > 0:
                # the first block's inputs need no gradient: its backward hook then fires on
                # the gradients of its outputs, which torch warns about; that timing is wanted
                warnings.filterwarnings("ignore",
                                        message="Full backward hook is firing when gradients")
                self._handles += [m.register_full_backward_pre_hook(start("bwd")),
                                  m.register_full_backward_hook(stop("bwd"))]

    def _install_events(self, blocks: Sequence[nn.Module], device: torch.device) -> None:
        started: dict[int, Any] = {}
        stream = torch.cuda.current_stream(device)  # the one the step's kernels run on

        def event() -> Any:
            if self._free:
                return self._free.pop()
            return torch.cuda.Event(enable_timing=True)

        def start(mod: Any, *_args: Any) -> None:
            e = event()
            e.record(stream)
            started[id(mod)] = e

        def stop(mod: Any, *_args: Any) -> None:
            s = started.pop(id(mod), None)
            if s is None:
                return
            e = event()
            e.record(stream)
            self._spans.append((s, e))

        for m in blocks:
            self._handles += [m.register_forward_pre_hook(start),
                              m.register_forward_hook(stop)]

    def take(self) -> float:
        if self._spans:
            self._spans[-1][1].synchronize()  # one stream: every earlier span is done too
            self._fwd += sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
            self._free += [ev for pair in self._spans for ev in pair]
            self._spans = []
        out, self._fwd = self._fwd, 0.0
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._fwd = 0.0
        self._spans = []


def median(xs: Sequence[float]) -> float:
    """The upper median (one of the figures; ``statistics.median_high``), 0 when empty."""
    return statistics.median_high(xs) if xs else 0.0
