"""Bucketed gradient reduction (``strategies.buckets``): the plan, the sums each rank holds
after a backward in both modes (an unused parameter and mixed dtypes included), and the
number of messages a ZeRO step sends for a model of many small tensors (issue 16: it was one
per tensor). Two spawned gloo processes (``tests/mp_harness.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from strategies.buckets import bucket_plan
from tests.mp_harness import ProcessPool


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(2)
    yield p
    p.close()


def test_bucket_plan() -> None:
    f32, f64 = torch.float32, torch.float64
    # reverse order; the first bucket closes at first_cap, later ones at cap
    sizes = [(400, f32), (400, f32), (400, f32), (400, f32), (400, f32)]
    assert bucket_plan(sizes, cap=1000, first_cap=500) == [[4], [3, 2], [1, 0]]
    # a dtype change closes a bucket; a tensor over the cap is a bucket of its own
    sizes = [(100, f32), (100, f64), (300, f64), (5000, f32), (100, f32)]
    assert bucket_plan(sizes, cap=1000, first_cap=1000) == [[4], [3], [2, 1], [0]]
    assert bucket_plan([], cap=10) == []


def _reduce(mode: str) -> dict[str, Any]:
    import torch.distributed as dist

    from strategies.buckets import GradBuckets

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same parameters on both ranks
    params = [torch.nn.Parameter(torch.randn(n, dtype=dt)) for n, dt in
              [(30, torch.float32), (7, torch.float32), (50, torch.float64), (20, torch.float32),
               (9, torch.float32)]]
    owner = [0, 1, 1, 0, 1]
    gb = GradBuckets(params, owner, mode, None, [0, 1], rank, cap=120, first_cap=100)
    assert len(gb.buckets) >= 3  # several buckets, one dtype each
    gb.attach_hooks()
    out: dict[str, Any] = {"steps": []}
    for step in range(2):
        for p in params:
            p.grad = None
        # rank r's gradient of parameter i is (r + 1) * (i + 1) * (step + 1); parameter 1
        # is unused (no gradient anywhere)
        loss = sum((p * (rank + 1) * (i + 1) * (step + 1)).sum()
                   for i, p in enumerate(params) if i != 1)
        loss.backward()  # type: ignore[union-attr]
        gb.flush()
        out["steps"].append([None if p.grad is None else p.grad.clone() for p in params])
        out.setdefault("sq", []).append(None if gb.last_sq is None else float(gb.last_sq))
    gb.close()
    return out


@pytest.mark.parametrize("mode", ["all_reduce", "owned"])
def test_gradients_hold_the_sums(pool: ProcessPool, mode: str) -> None:
    results = pool.run(_reduce, mode, world_size=2)
    owner = [0, 1, 1, 0, 1]
    for step in range(2):
        for rank, r in enumerate(results):
            for i, g in enumerate(r["steps"][step]):
                keeps = mode == "all_reduce" or owner[i] == rank
                if i == 1 or not keeps:
                    assert g is None, (mode, rank, i)
                    continue
                want = (1 + 2) * (i + 1) * (step + 1)  # the sum over both ranks
                assert torch.equal(g, torch.full_like(g, want)), (mode, rank, i)
            # owned: every rank added up the squared norm of the whole summed gradient, no
            # message of its own; all_reduce mode leaves it to the caller
            sizes = [30, 7, 50, 20, 9]
            want_sq = sum(n * ((1 + 2) * (i + 1) * (step + 1)) ** 2
                          for i, n in enumerate(sizes) if i != 1)
            if mode == "owned":
                assert r["sq"][step] == pytest.approx(want_sq, rel=1e-6), (rank, step)
            else:
                assert r["sq"][step] is None


def _messages(name: str) -> dict[str, int]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from elastic.reference import build_model
    from strategies import Runtime, StrategySpec, get

    counts = {"all_reduce": 0, "reduce": 0, "broadcast": 0}
    real = {k: getattr(dist, k) for k in counts}

    def counting(kind: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            counts[kind] += 1
            return real[kind](*a, **kw)
        return call

    def make() -> nn.Module:  # 96 small tensors, like an MLP-Mixer's
        return nn.Sequential(*[nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                                             nn.Linear(16, 16)) for _ in range(24)])

    spec = StrategySpec(name, 2, (4, 4))
    strat = get(name)(spec, Runtime.current(), build_model(make, 0),
                      lambda p: torch.optim.Adam(p, lr=1e-3), F.mse_loss)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    strat.train_step(x, y)
    for k in counts:
        setattr(dist, k, counting(k))
    try:
        for _ in range(3):
            strat.train_step(x, y)
    finally:
        for k, f in real.items():
            setattr(dist, k, f)
    strat.close()
    return {k: v // 3 for k, v in counts.items()}


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_a_zero_step_sends_a_few_messages(pool: ProcessPool, name: str) -> None:
    """96 parameter tensors (26 KB of gradients: one bucket): one all-reduce, then one
    broadcast per owner; it was one message per tensor. Neither sends a message for the
    global gradient norm (every step: issue 13): zero1's ranks hold the whole gradient, and
    zero2's add up the squares of every bucket's sums as they arrive."""
    per_step = pool.run(_messages, name, world_size=2)[0]
    assert per_step == {"all_reduce": 1, "reduce": 0, "broadcast": 2}


_USE = {  # (pass, rank) -> the parameters whose gradient that backward has
    (0, 0): {0, 1}, (0, 1): {0, 1},  # parameter 1: the first micro-batch only
    (1, 0): {0, 2}, (1, 1): {0},  # parameter 2: one rank's samples only; 3: none at all
}


def _uneven(mode: str, cap: int) -> dict[str, Any]:
    import torch.distributed as dist

    from strategies.buckets import GradBuckets

    rank = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (30, 7, 20, 9)]
    gb = GradBuckets(params, [0, 1, 1, 0], mode, None, [0, 1], rank, cap=cap, first_cap=cap)
    gb.attach_hooks()
    calls = {"all_reduce": 0}
    real = dist.all_reduce

    def counting(*a: Any, **kw: Any) -> Any:
        calls["all_reduce"] += 1
        return real(*a, **kw)

    dist.all_reduce = counting
    try:
        passes = 2 if mode == "owned" else 1  # zero2 reduces every micro-batch; zero1 the last
        for k in range(passes):
            used = _USE[(k + (2 - passes), rank)]
            loss = sum((p * (rank + 1) * (i + 1) * (k + 1)).sum()
                       for i, p in enumerate(params) if i in used)
            loss.backward()  # type: ignore[union-attr]
            gb.flush()
    finally:
        dist.all_reduce = real
    out = {"grads": [None if p.grad is None else p.grad.clone() for p in params],
           "sq": None if gb.last_sq is None else float(gb.last_sq), "calls": calls}
    gb.close()
    return out


@pytest.mark.parametrize("cap", [60, 400])  # a bucket per parameter; all in one bucket
@pytest.mark.parametrize("mode", ["owned", "all_reduce"])
def test_ranks_whose_gradients_differ_send_the_same_buckets_and_get_the_sums(
        pool: ProcessPool, mode: str, cap: int) -> None:
    """A parameter with a gradient in an earlier micro-batch only (summed on its owner
    then), one that only one rank's samples reach, one that nobody's do: every rank sends
    every bucket alike, and the gradients are the sums of what every rank and micro-batch
    had (None where nobody had one, as in one process); zero2's norm is the same on both
    ranks. Was: each rank packed only its own gradients, back to back, so the sums mixed
    parameters (19 where 33 was due), a bucket without a gradient here was not sent (the
    ranks' collectives out of step: a hang), and the norm differed between ranks."""
    results = pool.run(_uneven, mode, cap, world_size=2)
    passes = 2 if mode == "owned" else 1
    owner = [0, 1, 1, 0]
    want: dict[int, float] = {}
    for k in range(passes):
        for r in range(2):
            for i in _USE[(k + (2 - passes), r)]:
                want[i] = want.get(i, 0.0) + (r + 1) * (i + 1) * (k + 1)
    for rank, r in enumerate(results):
        for i, g in enumerate(r["grads"]):
            keeps = (mode == "all_reduce" or owner[i] == rank) and i in want
            if not keeps:
                assert g is None, (mode, rank, i, g)
            else:
                assert g is not None and torch.equal(g, torch.full_like(g, want[i])), (
                    mode, rank, i, g)
    assert results[0]["calls"] == results[1]["calls"]
    if mode == "owned":
        sizes = [30, 7, 20, 9]
        sq = sum(sizes[i] * v ** 2 for i, v in want.items())
        assert results[0]["sq"] == results[1]["sq"] == pytest.approx(sq, rel=1e-6)
