"""``strategies.dp.BucketNorms``: dp's gradient norm, taken from each reduced bucket in DDP's
comm hook. Every rank clips and skips by it, so it must be exact to float32 rounding and
the same bits on every rank whatever order the buckets' callbacks ran in."""

from __future__ import annotations

import math

import torch

from strategies.dp import BucketNorms


def _buckets(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 1e-3 for n in sizes]


def test_the_norm_of_large_buckets_is_exact_to_float32_rounding() -> None:
    """A 6.5M-element bucket (DDP's 25 MB cap): one float32 norm of it is off by ~4e-4
    relative; the rows' norms summed in float64 by ~1e-8."""
    buckets = _buckets([6_500_000, 262_144, 1_000_003])
    norms = BucketNorms(sum(b.numel() for b in buckets))
    for i, b in enumerate(buckets):
        norms.add(i, b)
    got = norms.take()
    assert got is not None and got.dtype == torch.float64
    exact = sum(float(b.double().square().sum()) for b in buckets)
    assert abs(float(got) - exact) / exact < 1e-7


def test_every_order_of_callbacks_gives_the_same_bits() -> None:
    """Gloo may finish two buckets' all-reduces in either order on different ranks."""
    buckets = [b * 10.0 ** (i % 7) for i, b in enumerate(_buckets(
        [70_000, 4096, 5, 300_001] + [1000 + 37 * i for i in range(20)], seed=1))]
    total = sum(b.numel() for b in buckets)
    results = set()
    n = len(buckets)
    for order in (list(range(n)), list(range(n))[::-1], [(7 * i) % n for i in range(n)]):
        norms = BucketNorms(total)
        for i in order:
            norms.add(i, buckets[i])
        got = norms.take()
        assert got is not None
        results.add(float(got).hex())
    assert len(results) == 1, results


def test_a_step_that_reached_only_some_buckets_gives_none_and_starts_afresh() -> None:
    a, b = _buckets([1000, 3000], seed=2)
    norms = BucketNorms(4000)
    norms.add(1, b)
    assert norms.take() is None  # the caller takes the norm of the gradients itself
    norms.add(0, a)
    norms.add(1, b)
    norms.clear()  # a new step
    norms.add(0, a)
    norms.add(1, b)
    got = norms.take()
    assert got is not None
    assert math.isclose(float(got), float(a.double().square().sum() + b.double().square().sum()),
                        rel_tol=1e-6)
    assert norms.take() is None  # taken once


def test_a_nan_or_inf_anywhere_makes_the_norm_not_finite() -> None:
    for bad in (float("nan"), float("inf")):
        a, b = _buckets([5000, 9000], seed=3)
        b[4321] = bad
        norms = BucketNorms(14000)
        norms.add(0, a)
        norms.add(1, b)
        got = norms.take()
        assert got is not None and not math.isfinite(float(got))
