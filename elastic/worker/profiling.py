"""Profiling on a worker: how fast this device runs the job's model, how fast the group talks,
and the emulated slowdown that tests and demos use to stand for a slower device.

The planner and the balancer read these figures (``clusters``); an emulated device reports
what it emulates (docs/architecture.md, Heterogeneous devices).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import JobConfig, WorkerConfig
from ..reference import build_model
from .inputs import JobData
from .layout import compute_blocks
from .measure import profile_terms
from .spans import SpanHooks

__all__ = ["Profiler"]


class Profiler:
    """This worker's emulation settings and the hooks that carry them out, plus the
    measurements (``profile``, ``profile_terms``).

    ``set_emulation`` may run on the controller's thread while a step runs: it only marks
    the hooks stale, and the step loop re-installs them between steps (``refresh``).
    """

    def __init__(self, config: JobConfig | WorkerConfig, device: torch.device, data: JobData,
                 model_factory: Callable[[], Any], loss_fn: Callable[..., Any]) -> None:
        self._config = config
        self._device = device
        self._data = data
        self._model_factory = model_factory
        self._loss_fn = loss_fn
        self.emulation: dict[str, Any] = {}
        self.slowdown = 1.0
        self._spans = SpanHooks()  # per-block timing and the emulated slowdown's sleeps
        self._dirty = False

    # ------------------------------------------------------------------ emulation

    def set_emulation(self, emulation: dict[str, Any] | None) -> None:
        """Test and demo aid: emulate a slower device (``slowdown`` x compute time, a
        ``memory_gb`` budget for the planner, ``stands_for`` a display name)."""
        self.emulation = dict(emulation or {})
        self.slowdown = max(1.0, float(self.emulation.get("slowdown", 1.0)))
        self._dirty = True

    def slow_down(self, factor: float) -> None:
        """From the next step, compute ``factor`` times slower (the ``slowdown`` fault)."""
        self.set_emulation({**self.emulation, "slowdown": factor})

    def display_name(self, device_name: str) -> str:
        """How this device is shown: an emulated one says what it stands for."""
        if not self.emulation:
            return device_name
        return (f"{self.emulation.get('stands_for') or device_name} (emulated on "
                f"{device_name}, x{self.slowdown:g})")

    def refresh(self, strategy: Any) -> None:
        """Between steps: re-install the hooks if the emulation changed meanwhile."""
        if self._dirty:
            self.install(strategy)

    def install(self, strategy: Any) -> None:
        """(Re)install the hooks on ``strategy``, a layout just built (no reference to it is
        kept: a dropped layout must release its group): every block this rank runs (each
        pipeline stage's blocks, else the model's blocks, else the whole model) is timed in
        its forward (this rank's own compute, ``take_compute``), and on an emulated slower
        device sleeps ``(slowdown - 1) x`` its forward's time right after its forward and
        ``(slowdown - 1) x`` its backward's time right after its backward. So each phase is
        slow where it happens: a slow pipeline stage on every micro-batch, a slow zero3 rank
        in each block's forward *and* backward (whose gathers and reduce-scatters synchronize
        the ranks block by block), and collectives between blocks are not slowed
        (``spans.SpanHooks``)."""
        self._dirty = False
        if strategy is None:
            self._spans.remove()
            return
        self._spans.install(compute_blocks(strategy), self.slowdown, self._device)

    def take_compute(self) -> float:
        """Seconds spent inside this rank's blocks' forwards since the last call."""
        return self._spans.take()

    # ------------------------------------------------------------------ measurements

    def _sync(self) -> Callable[[], None]:
        return torch.cuda.synchronize if self._device.type == "cuda" else (lambda: None)

    def _autocast(self) -> Any:
        """The job's compute precision for the profiler's private forward passes."""
        return torch.autocast(self._device.type, dtype=torch.bfloat16,
                              enabled=self._config.precision == "bf16")

    def profile(self, batch: int, detail: bool = False) -> dict[str, Any]:
        """Measure this worker's speed for the job's model: samples/s of forward+backward,
        including its emulated slowdown (an emulated device reports what it emulates). With
        ``detail``: per-block forward+backward seconds per sample and the activation bytes
        per sample each block hands on (what a pipeline split needs). The job's random state
        is left as it was (``_own_rng``)."""
        with self._own_rng():
            return self._profile(batch, detail)

    def _own_rng(self) -> Any:
        """The profile's models are seeded and run in training mode (dropout draws): on a
        fork of the random state, so that a profile mid-run (a re-balance, a re-plan) does not
        reset or advance the job's (was: reseeded at the job's seed, then advanced by a
        number of forwards that depended on timing)."""
        devices = [self._device] if self._device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    def _profile(self, batch: int, detail: bool) -> dict[str, Any]:
        base = self._base(batch)
        out: dict[str, Any] = {"samples_per_s": 1.0 / (base * self.slowdown),
                               "base_s_per_sample": base}
        if detail:
            out.update(self._blocks(batch))
        return out

    def _base(self, batch: int, min_s: float = 0.05, max_iters: int = 50) -> float:
        """Seconds per sample of forward+backward of a private copy of the model (no
        collective), before any emulated slowdown: the median of at least 5 timed iterations
        and at least ``min_s`` seconds of them (tiny models are noisy on a busy host)."""
        model = build_model(self._model_factory, self._config.seed).to(self._device)
        x, y = self._data.first(batch)
        x, y = x.to(self._device), y.to(self._device)
        times: list[float] = []
        sync = self._sync()
        for i in range(max_iters + 1):
            t0 = time.perf_counter()
            with self._autocast():
                loss = self._loss_fn(model(x), y)
            loss.backward()
            sync()
            if i:  # the first iteration warms up
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            if len(times) >= 5 and sum(times) >= min_s:
                break
        return sorted(times)[len(times) // 2] / batch

    def _blocks(self, batch: int, iters: int = 3) -> dict[str, Any]:
        """Per block of the model: forward+backward seconds per sample (emulation included)
        and the bytes per sample of the activation it hands on."""
        from strategies.blocks import blocks_of

        model = build_model(self._model_factory, self._config.seed).to(self._device)
        x, _ = self._data.first(batch)
        h = x.to(self._device)
        secs, bounds = [], []
        sync = self._sync()
        for block in blocks_of(model):
            inp = h.detach().requires_grad_(h.is_floating_point())
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                with self._autocast():
                    out = block(inp)
                out.backward(torch.ones_like(out))
                sync()
                times.append(time.perf_counter() - t0)
                block.zero_grad(set_to_none=True)
            secs.append(sorted(times)[iters // 2] / batch * self.slowdown)
            bounds.append(out.numel() * out.element_size() / batch)
            h = out.detach()
        return {"block_seconds": secs, "boundary_bytes": bounds}

    def profile_terms(self, shares: list[int], rank: int, world: int,
                      control: Callable[[], Any], rounds: int = 7) -> dict[str, Any]:
        """Collective: this rank's measurements for the planner's cost model, each repeated
        ``rounds`` times (``measure.profile_terms``; trial dp steps under ``shares`` with the
        step loop's data fetch and ``control`` all-reduce)."""
        lo = sum(shares[:rank])
        hi = lo + shares[rank]
        with self._own_rng():
            return profile_terms(
                model_factory=lambda: build_model(self._model_factory, self._config.seed),
                loss_fn=self._loss_fn, optimizer_factory=self._config.optimizer_factory(),
                batch=lambda step: self._data.batch(step, lo, hi), shares=shares, rank=rank,
                world=world, device=self._device, autocast=self._autocast,
                slowdown=self.slowdown, rounds=rounds, control=control)
