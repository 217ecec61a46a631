"""The profiler's trial steps on two spawned gloo ranks (``tests/mp_harness.py``): the dp steps
with and without the optimizer's update run on until rank 0's rule says the difference is
resolved, and every rank runs as many as rank 0; then pipeline steps with their schedule
timed (``elastic.worker.measure.profile_terms``,
``clusters.measured.more_update_steps``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.mp_harness import ProcessPool


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(2)
    yield p
    p.close()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)  # a share


def _profile(want: int | None) -> dict[str, int]:
    """This rank's counts of trial steps; ``want``: rank 0's rule replaced by one asking for
    more until ``want`` steps of each kind ran (None: the real rule)."""
    import torch.distributed as dist

    from elastic.worker import measure

    rank = dist.get_rank()
    if want is not None:
        def rule(with_update: Any, without: Any, alone: float) -> bool:
            assert rank == 0, "only rank 0 decides"
            return min(len(with_update), len(without)) < want
        measure.more_update_steps = rule  # type: ignore[assignment]
    rep = measure.profile_terms(
        model_factory=_model, loss_fn=torch.nn.functional.mse_loss, optimizer_factory=_adam,
        batch=_batch, shares=[4, 4], rank=rank, world=2, device=torch.device("cpu"),
        autocast=contextlib.nullcontext, rounds=2)
    pipe = rep.get("trial_pipeline", {})
    assert all(0 < s <= t for r in pipe["runs"]
               for s, t in zip(r["schedule_seconds"], r["seconds"], strict=True))
    return {"with": len(rep["trial"]["seconds"]),
            "without": len(rep["trial_no_update"]["seconds"]),
            "zero3": len(rep.get("trial_zero3", {}).get("seconds", [])),
            "pipeline": ([(r["micro_batches"], len(r["seconds"])) for r in pipe["runs"]],
                         sorted(pipe["split"]))}


def test_the_ranks_run_as_many_trial_steps_as_rank_0_asks(pool) -> None:
    # 6 of each kind first; each further pair of blocks of 3 adds 2 of each (a block's
    # first step, which follows the other kind, is not counted)
    # and a pipeline over both ranks: 1F1B at 2 micro-batches (the fewest >= 2 that divide
    # 8) and at 4, its 3 blocks cut by rank 0's block times, one split for both
    assert pool.run(_profile, 10) == [{"with": 10, "without": 10, "zero3": 3,
                                       "pipeline": ([(2, 3), (4, 3)], [1, 2])}] * 2
    real = pool.run(_profile, None)
    assert real[0] == real[1]
    assert 6 <= real[0]["with"] == real[0]["without"] <= 24
