"""``SpanHooks``: the seconds a rank spends inside its blocks' forwards (the closed loop's
per-rank compute) and the emulated slowdown's sleeps. On CUDA the spans are timed by events
(a forward's host time there is its kernels' launch time); that test needs a GPU."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from elastic.worker.spans import SpanHooks


class _Sleep(nn.Module):
    """A block whose forward takes ``s`` seconds of host time."""

    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.s)
        return x * self.w


def test_the_forward_spans_are_summed_and_taken_once() -> None:
    blocks = [_Sleep(0.02) for _ in range(3)]
    h = SpanHooks()
    h.install(blocks, 1.0, torch.device("cpu"))
    x = torch.ones(2)
    for b in blocks:
        x = b(x)
    t = h.take()
    assert 0.06 <= t < 0.06 + 0.05
    assert h.take() == 0.0  # taken: nothing since
    h.remove()
    blocks[0](x)
    assert h.take() == 0.0  # removed: not timed


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return g


class _SleepBoth(_Sleep):
    """20 ms in its forward and 20 ms in its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(super().forward(x))


def test_an_emulated_slowdown_sleeps_in_the_forward_and_the_backward() -> None:
    blocks = [_SleepBoth(0.02) for _ in range(2)]
    h = SpanHooks()
    h.install(blocks, 2.0, torch.device("cpu"))
    x = torch.ones(2, requires_grad=True)
    y = blocks[1](blocks[0](x))
    fwd = h.take()
    assert 0.08 <= fwd < 0.08 + 0.05  # each forward's 20 ms and as much again
    t0 = time.perf_counter()
    y.sum().backward()
    assert time.perf_counter() - t0 >= 0.08  # each backward's 20 ms and as much again
    assert h.take() == 0.0  # the backward's time is not the forward's
    h.remove()
    t0 = time.perf_counter()
    blocks[1](blocks[0](x)).sum().backward()
    assert time.perf_counter() - t0 < 0.08 + 0.03  # removed: no sleeps


class _Event:
    """What a CUDA event gives the hooks, on the host's clock (no GPU here)."""

    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        _Event.made += 1
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        assert self.t is not None

    def elapsed_time(self, end: _Event) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's


def test_on_a_cuda_device_spans_are_read_from_events_and_the_events_reused(monkeypatch) -> None:
    """The CUDA path's bookkeeping without a GPU: each forward between two events, read at
    ``take`` (ms to s), the events then reused; ``remove`` drops unread spans."""
    monkeypatch.setattr(_Event, "made", 0)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    blocks = [_Sleep(0.01) for _ in range(3)]
    h = SpanHooks()
    h.install(blocks, 1.0, torch.device("cuda"))
    x = torch.ones(2)
    for _ in range(2):
        y = x
        for b in blocks:
            y = b(y)
        assert 0.03 <= h.take() < 0.03 + 0.03
    assert _Event.made == 6  # the second step's six were the first step's, reused
    blocks[0](x)
    h.remove()
    assert h.take() == 0.0  # removed: the unread span dropped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_span_is_the_kernels_time_not_their_launch() -> None:
    dev = torch.device("cuda")
    blocks = [nn.Linear(4096, 4096).to(dev) for _ in range(3)]
    x = torch.randn(8192, 4096, device=dev)
    h = SpanHooks()
    h.install(blocks, 1.0, dev)
    with torch.no_grad():
        for _ in range(2):  # warm up (cuBLAS's handles and plans)
            y = x
            for b in blocks:
                y = b(y)
        torch.cuda.synchronize()
        h.take()
        t0 = time.perf_counter()
        y = x
        for b in blocks:
            y = b(y)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    t = h.take()
    # host timing would give the launches' microseconds against the kernels' milliseconds
    assert 0.5 * wall <= t <= 1.05 * wall, (t, wall)
    h.remove()
