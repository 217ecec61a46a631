"""The profiler's trial steps on two spawned gloo ranks (``tests/mp_harness.py``): the dp steps
with and without the optimizer's update run on until rank 0's rule says the difference is
resolved, and every rank runs as many as rank 0; then zero1's and zero3's, and a pipeline's
at two micro-batch counts, each in rotation with dp's and on until rank 0 finds its medians
settled, the schedule timed (``elastic.worker.measure.profile_terms``,
``clusters.measured.more_update_steps``, ``more_trial_steps``)."""

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


def _profile(want: int | None, want_trial: int | None = None) -> dict[str, int]:
    """This rank's counts of trial steps; ``want``: rank 0's rule for the steps with and
    without the update replaced by one asking for more until ``want`` steps of each kind
    ran, ``want_trial`` the same for zero1's and zero3's (None: the real rules)."""
    import torch.distributed as dist

    from clusters.measured import more_trial_steps, more_update_steps
    from elastic.worker import measure

    rank = dist.get_rank()

    def rule(with_update: Any, without: Any, alone: float) -> bool:
        assert rank == 0, "only rank 0 decides"
        return min(len(with_update), len(without)) < (want or 0)

    def trial_rule(secs: Any, per_round: int, noise: float) -> bool:
        assert rank == 0, "only rank 0 decides"
        assert 0 < noise < 10, noise  # the dp trial's spread per step, relative
        return len(secs) < (want_trial or 0)

    # (the pool's processes live on: the real rules are put back for the next run)
    measure.more_update_steps = rule if want else more_update_steps  # type: ignore
    measure.more_trial_steps = trial_rule if want_trial else more_trial_steps  # type: ignore
    rep = measure.profile_terms(
        model_factory=_model, loss_fn=torch.nn.functional.mse_loss, optimizer_factory=_adam,
        batch=_batch, shares=[4, 4], rank=rank, world=2, device=torch.device("cpu"),
        autocast=contextlib.nullcontext, rounds=2)
    pipe = rep.get("trial_pipeline", {})
    # where the profile's time went, each part once, in the order it ran
    assert list(rep["phases"]) == ["compute", "blocks", "optimizer", "collectives", "trial_dp",
                                   "trial_zero1", "trial_zero3", "trial_pipeline"]
    assert all(v > 0 for v in rep["phases"].values()), rep["phases"]
    assert all(0 < s <= t for r in pipe["runs"]
               for s, t in zip(r["schedule_seconds"], r["seconds"], strict=True))
    return {"with": len(rep["trial"]["seconds"]),
            "without": len(rep["trial_no_update"]["seconds"]),
            "zero1": (len(rep.get("trial_zero1", {}).get("seconds", [])),
                      len(rep.get("trial_zero1", {}).get("dp_seconds", []))),
            "zero3": (len(rep.get("trial_zero3", {}).get("seconds", [])),
                      len(rep.get("trial_zero3", {}).get("dp_seconds", []))),
            "pipeline": ([(r["micro_batches"], len(r["seconds"])) for r in pipe["runs"]],
                         sorted(pipe["split"]), len(pipe["dp_seconds"]))}


def test_the_ranks_run_as_many_trial_steps_as_rank_0_asks(pool) -> None:
    # 6 of each kind first; each further pair of blocks of 3 adds 2 of each (a block's
    # first step, which follows the other kind, is not counted)
    # then zero1 and dp in rotation, blocks of 3 each (2 counted steps per block) until 8 of
    # zero1's counted, zero3 and dp the same way; and a
    # pipeline over both ranks: 1F1B at 2 micro-batches (the fewest >= 2 that divide 8) and
    # at 8 (the most that divide 8 up to 4 times 2), with dp in rotation, blocks of each
    # until 8 of each count, its 3 blocks cut by rank 0's block times, one split for both
    assert pool.run(_profile, 10, 8) == [{"with": 10, "without": 10, "zero1": (8, 8),
                                          "zero3": (8, 8),
                                          "pipeline": ([(2, 8), (8, 8)], [1, 2], 8)}] * 2
    real = pool.run(_profile, None)
    assert real[0] == real[1]
    assert 6 <= real[0]["with"] == real[0]["without"] <= 24
    assert 4 <= real[0]["zero1"][0] == real[0]["zero1"][1] <= 8
    assert 4 <= real[0]["zero3"][0] == real[0]["zero3"][1] <= 8
    (_, a), (_, b) = real[0]["pipeline"][0]
    assert 4 <= a == b == real[0]["pipeline"][2] <= 8


def _profile_without_room_on_rank_1() -> dict[str, Any]:
    """The trial as rank 1 would run it on a device with no room for dp's replica beside
    zero3's shards or two pipeline stages."""
    import torch.distributed as dist

    from clusters.measured import more_trial_steps
    from elastic.worker import measure, trial

    real = trial.room_beside
    trial.room_beside = lambda *a: dist.get_rank() != 1  # type: ignore[assignment]
    measure.more_trial_steps = lambda secs, per_round, noise: False  # type: ignore[assignment]
    try:
        rep = measure.profile_terms(
            model_factory=_model, loss_fn=torch.nn.functional.mse_loss,
            optimizer_factory=_adam, batch=_batch, shares=[4, 4], rank=dist.get_rank(),
            world=2, device=torch.device("cpu"), autocast=contextlib.nullcontext, rounds=2)
    finally:
        trial.room_beside = real
        measure.more_trial_steps = more_trial_steps  # type: ignore[assignment]
    z1, z3, pipe = rep["trial_zero1"], rep["trial_zero3"], rep["trial_pipeline"]
    return {"zero1": (len(z1["seconds"]), "dp_seconds" in z1),
            "zero3": (len(z3["seconds"]), "dp_seconds" in z3),
            "pipeline": ([(r["micro_batches"], len(r["seconds"])) for r in pipe["runs"]],
                         "dp_seconds" in pipe)}


def test_without_room_on_one_device_every_rank_runs_each_layout_alone(pool) -> None:
    # one rank's device cannot hold dp's replica beside the others: no rank rotates (the
    # ranks would otherwise run different collectives), each layout runs alone, at no level
    # (zero1 or zero3 alone: all of its 6 steps count, no block follows another layout)
    assert pool.run(_profile_without_room_on_rank_1) == [
        {"zero1": (6, False), "zero3": (6, False), "pipeline": ([(2, 4), (8, 4)], False)}] * 2


class _NotTwo(torch.nn.Module):
    """Raises on a batch of 2 samples, as a batch norm does on 1: the pipeline's stage that
    holds it fails while the others wait for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:
            raise ValueError("a batch of 2")
        return x


def _picky_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), _NotTwo(),
                               torch.nn.Linear(64, 1))


def _batch6(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 16, generator=g), torch.randn(6, 1, generator=g)


def _picky_profile() -> list[int]:
    import torch.distributed as dist

    from elastic.worker import measure

    rep = measure.profile_terms(
        model_factory=_picky_model, loss_fn=torch.nn.functional.mse_loss,
        optimizer_factory=_adam, batch=_batch6, shares=[6, 6], rank=dist.get_rank(), world=2,
        device=torch.device("cpu"), autocast=contextlib.nullcontext, rounds=2)
    return [(r["micro_batches"], len(r["seconds"])) for r in rep["trial_pipeline"]["runs"]]


def test_a_pipeline_count_one_stage_cannot_take_is_skipped_on_every_rank(pool) -> None:
    # 12 samples: micro-batches of 6 (m = 2) run; of 2 (m = 6, the most that divide 12 up
    # to 4 times 2) one stage would raise while the other waits in a receive: every rank
    # takes the next most instead, m = 4 (3 samples)
    a, b = pool.run(_picky_profile)
    assert a == b and [m for m, _ in a] == [2, 4]
    assert all(4 <= n <= 8 for _, n in a)  # on while rank 0 finds them unsettled
