"""An optimizer factory whose settings depend on the parameters' position is refused where a
layout builds the optimizer on a subset (zero1, zero2: a rank's own; pipelines: a stage's).

Layer-wise lr decay by ``enumerate(params)`` gave zero1's and a pipeline's parameters other
learning rates than dp's, silently. Two spawned gloo processes (``tests/mp_harness.py``), no
Ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.mp_harness import ProcessPool

SHARES = (4, 4)
PP2 = dict(pp_degree=2, micro_batches=2, schedule="gpipe")
CALLS: list[int] = []  # factory calls in this process (how many parameters each)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def layerwise_decay(params: Any) -> torch.optim.Optimizer:
    """lr halves with each parameter's position: depends on the list it is given."""
    ps = list(params)
    CALLS.append(len(ps))
    return torch.optim.SGD([{"params": [p], "lr": 0.1 * 0.5 ** i} for i, p in enumerate(ps)],
                           lr=0.1)


def no_decay_on_biases(params: Any) -> torch.optim.Optimizer:
    """Groups by the parameters themselves (their shape): the same for any list."""
    ps = list(params)
    CALLS.append(len(ps))
    return torch.optim.AdamW([{"params": [p for p in ps if p.ndim > 1]},
                              {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0}],
                             lr=1e-3, weight_decay=0.1)


FACTORIES = {"layerwise": layerwise_decay, "by_shape": no_decay_on_biases}


def _build(name: str, kw: dict[str, Any], factory: str) -> dict[str, Any]:
    """Runs on every rank: build ``name`` with the factory, take a step. Returns the
    refusal's message (None: built) and the factory's calls."""
    from elastic.reference import build_model
    from strategies import Runtime, StrategyError, StrategySpec, registry

    CALLS.clear()
    spec = StrategySpec(name=name, world_size=dist.get_world_size(), shares=SHARES, **kw)
    model = build_model(mlp, 5)
    cls = registry.get(name)
    cls.validate(spec, model)
    try:
        strat = cls(spec, Runtime.current("cpu"), model, FACTORIES[factory], F.mse_loss)
    except StrategyError as e:
        return {"refused": str(e), "calls": list(CALLS)}
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(sum(SHARES), 8, generator=g), torch.randn(sum(SHARES), 4, generator=g)
    lo = sum(SHARES[:dist.get_rank()])
    strat.train_step(x[lo:lo + SHARES[dist.get_rank()]], y[lo:lo + SHARES[dist.get_rank()]])
    strat.close()
    return {"refused": None, "calls": list(CALLS)}


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPool]:
    p = ProcessPool(2)
    yield p
    p.close()


@pytest.mark.parametrize("name,kw,how", [
    ("zero1", {}, "zero1 builds it on the parameters a rank owns"),
    ("pipeline", PP2, "a pipeline builds it on the parameters of a rank's stages"),
])
def test_a_factory_that_sets_lr_by_position_is_refused_on_subsets(
        pool: ProcessPool, name: str, kw: dict[str, Any], how: str) -> None:
    # was: built, each parameter stepped with the lr of its position in the rank's subset
    results = pool.run(_build, name, kw, "layerwise", world_size=2)
    for r in results:  # every rank refuses alike (none is left in a collective)
        msg = r["refused"]
        assert msg is not None
        assert "the optimizer factory gives parameter " in msg
        assert " lr " in msg and "when built on all parameters but" in msg
        assert how in msg and "split param groups by the parameters themselves" in msg


@pytest.mark.parametrize("name,kw", [("zero1", {}), ("pipeline", PP2)])
def test_a_factory_that_groups_by_shape_is_accepted(
        pool: ProcessPool, name: str, kw: dict[str, Any]) -> None:
    results = pool.run(_build, name, kw, "by_shape", world_size=2)
    assert [r["refused"] for r in results] == [None, None]


def test_dp_builds_the_factory_once_and_does_not_check(pool: ProcessPool) -> None:
    results = pool.run(_build, "dp", {}, "layerwise", world_size=2)
    for r in results:
        assert r["refused"] is None
        assert r["calls"] == [8]  # its one optimizer, on every parameter
