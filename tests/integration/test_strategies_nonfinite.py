"""A non-finite step changes nothing, in every layout (issue 13 point 1).

One rank's inputs are NaN at one step, so its loss and its gradients are, and every
reduction spreads that to the gradients every other rank steps with. Every layout computes
the global gradient norm every step (clipping on or off) and, when it is NaN or inf, skips
the update on every rank alike (``strategy.skipped``). The parameters after the run must
then equal the single-process reference that draws that step's batch and skips its update
(``reference_train(skip_steps=...)``: no optimizer step, so Adam's step count stays too),
within the same ``ATOL`` as ``test_strategies.py``; and differ from the reference that
trains on it, so the test sees the skip.

Processes: a pool of 4 spawned gloo workers (``tests/mp_harness.py``), as test_strategies.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from elastic.reference import reference_train
from strategies import StrategySpec
from tests.integration.test_strategies import (
    ATOL,
    CASES,
    DATA,
    SEED,
    _Pool,
    _train,
    make_adam,
    make_mlp,
    max_param_diff,
)

STEPS = 6
NAN_STEP = 3


@pytest.fixture(scope="module")
def pool():
    p = _Pool()
    yield p
    p.close()


def _reference(g: int, skip: bool, clip: float | None = None) -> dict[str, torch.Tensor]:
    state, _ = reference_train(make_mlp, make_adam, F.mse_loss, DATA, g, STEPS, SEED,
                               max_grad_norm=clip, skip_steps={NAN_STEP} if skip else ())
    return state


# every layout of test_strategies.py (pipelines with dp, zero1, zero2, zero3 inside
# included), and two with clipping on (its coefficient must not turn a NaN into a number)
NAN_CASES = [(c, None) for c in CASES] + [("zero2-3", 0.4), ("pp2xzero1", 0.4)]


@pytest.mark.parametrize("case,clip", NAN_CASES,
                         ids=[c + ("-clip" if k else "") for c, k in NAN_CASES])
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(pool: _Pool, case: str,
                                                          clip: float | None) -> None:
    name, world, kw = CASES[case]
    spec = StrategySpec(name=name, world_size=world, **kw)
    if clip is not None:
        kw = {**kw, "options": {"max_grad_norm": clip}}
    bad_rank = world - 1  # one rank only (in a pipeline: a later stage's replica slice)
    results = pool.run(_train, name, kw, STEPS, 0, None, "cpu", make_adam, (bad_rank, NAN_STEP),
                       world_size=world)
    for r in results:  # every rank skipped that step, and only that one
        assert r["skipped"] == [s == NAN_STEP for s in range(STEPS)], r["skipped"]
        assert not math.isfinite(r["grad_norms"][NAN_STEP])
        assert all(math.isfinite(n) for i, n in enumerate(r["grad_norms"]) if i != NAN_STEP)
    assert len({r["hash"] for r in results}) == 1, "full_state() differs between ranks"
    state = results[0]["state"]
    assert all(bool(torch.isfinite(v).all()) for v in state.values())
    g = spec.global_batch_size
    assert max_param_diff(state, _reference(g, skip=True, clip=clip)) < ATOL
    assert max_param_diff(state, _reference(g, skip=False, clip=clip)) > 100 * ATOL
    # the skipped step left the optimizer alone: Adam counted STEPS - 1 updates
    steps = {float(v) for k, v in state.items() if k.startswith("optim/") and k.endswith("/step")}
    assert steps == {float(STEPS - 1)}, steps
