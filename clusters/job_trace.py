"""Synthetic multi-job traces: which jobs arrive when, at what size, for how long.

Shaped after published cluster traces, not copied from them: Microsoft's Philly (Jeon et al.,
ATC'19: most jobs ask for one GPU, few for more than 8, but those take a large share of the
GPU time; run times heavy-tailed from minutes to days) and SenseTime's Helios (Hu et al.,
SC'21: even more single-GPU jobs, shorter median). Arrivals are Poisson with a daily cycle
(busier by day), the rate set so that the jobs ask for ``load`` of the cluster on average.

A ``TraceJob`` gives its size request and its run time *at that size*; the simulator turns
the run time into steps with the job's predicted step time. The elastic range is
``requested // 4 .. 4 x requested`` (at least 1, at most ``max_scale``): what an elastic
scheduler may choose; FIFO-static always gives ``requested``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from .profile import ModelProfile, transformer_profile

__all__ = ["TraceJob", "TRACE_KINDS", "TRACE_MODELS", "job_trace", "trace_model"]

DAY = 86400.0


@dataclass(frozen=True)
class TraceJob:
    """A job of a trace: arrives at ``arrival_s``, asks for ``requested`` workers, runs
    ``duration_s`` at that size; ``model`` names one of ``TRACE_MODELS``."""

    name: str
    arrival_s: float
    requested: int
    min_workers: int
    max_workers: int
    duration_s: float
    model: str


@dataclass(frozen=True)
class _Kind:
    sizes: Mapping[int, float]  # size -> probability
    median_s: float  # run time at the requested size: lognormal median
    sigma: float  # and spread
    max_s: float  # run times are capped here


TRACE_KINDS: Mapping[str, _Kind] = {
    "philly": _Kind({1: 0.55, 2: 0.15, 4: 0.13, 8: 0.10, 16: 0.04, 32: 0.02, 64: 0.01},
                    median_s=4800.0, sigma=1.9, max_s=5 * DAY),
    "helios": _Kind({1: 0.65, 2: 0.10, 4: 0.10, 8: 0.09, 16: 0.03, 32: 0.02, 64: 0.01},
                    median_s=2400.0, sigma=2.1, max_s=5 * DAY),
}


def _models() -> dict[str, tuple[ModelProfile, int]]:
    """name -> (profile, global batch): a vision model, BERT, GPT-2 small/medium, 1.3B."""
    return {
        "resnet50": (ModelProfile.uniform(n_params=25.6e6, n_blocks=8,
                                          flops_per_sample=3 * 4.1e9,
                                          boundary_bytes=2e6, name="resnet50"), 256),
        "bert-base": (transformer_profile(layers=12, d_model=768, n_heads=12, seq_len=128,
                                          vocab=30522, name="bert-base"), 256),
        "gpt2-small": (transformer_profile(layers=12, d_model=768, n_heads=12, seq_len=1024,
                                           vocab=50257, name="gpt2-small"), 128),
        "gpt2-medium": (transformer_profile(layers=24, d_model=1024, n_heads=16, seq_len=1024,
                                            vocab=50257, name="gpt2-medium"), 128),
        "gpt-1.3b": (transformer_profile(layers=24, d_model=2048, n_heads=16, seq_len=2048,
                                         vocab=50257, name="gpt-1.3b"), 256),
    }


TRACE_MODELS: dict[str, tuple[ModelProfile, int]] = _models()


def trace_model(name: str) -> tuple[ModelProfile, int]:
    """The profile and global batch of ``TRACE_MODELS[name]``."""
    return TRACE_MODELS[name]


def _model_for(size: int, rng: random.Random) -> str:
    """Bigger requests tend to train bigger models."""
    if size <= 2:
        return rng.choice(("resnet50", "bert-base", "gpt2-small"))
    if size <= 8:
        return rng.choice(("bert-base", "gpt2-small", "gpt2-medium"))
    return rng.choice(("gpt2-medium", "gpt-1.3b"))


def _draw(rng: random.Random, kind: _Kind) -> tuple[int, float]:
    x, acc = rng.random(), 0.0
    size = max(kind.sizes)
    for s, p in kind.sizes.items():
        acc += p
        if x < acc:
            size = s
            break
    dur = min(kind.max_s, kind.median_s * math.exp(rng.gauss(0.0, kind.sigma)))
    return size, max(60.0, dur)


def job_trace(*, duration_s: float, capacity: int, load: float = 0.8, seed: int = 0,
              kind: str = "philly", max_scale: int = 64) -> list[TraceJob]:
    """Jobs arriving over ``duration_s`` that ask for ``load`` x ``capacity`` workers on
    average (Poisson, +-50 % over the day), sorted by arrival. Deterministic per ``seed``.
    ``ValueError`` for an unknown ``kind`` (``TRACE_KINDS``) or a load <= 0."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; use one of {', '.join(TRACE_KINDS)}")
    if not load > 0 or capacity < 1 or not duration_s > 0:
        raise ValueError("job_trace needs load > 0, capacity >= 1 and duration_s > 0")
    k = TRACE_KINDS[kind]
    probe = random.Random(seed + 7919)
    work = sum(s * d for s, d in (_draw(probe, k) for _ in range(20000))) / 20000
    rate = load * capacity / work  # jobs per second, on average
    peak = rate * 1.5
    rng = random.Random(seed)
    out: list[TraceJob] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() > (1.0 + 0.5 * math.sin(2 * math.pi * t / DAY)) / 1.5:
            continue  # thinning: the daily cycle
        size, dur = _draw(rng, k)
        size = min(size, capacity)
        out.append(TraceJob(f"j{len(out):05d}", t, size, max(1, size // 4),
                            min(capacity, max_scale, size * 4), dur, _model_for(size, rng)))
    return out
