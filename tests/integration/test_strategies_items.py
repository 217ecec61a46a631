"""A loss that averages over tokens trains what one process trains, in every layout.

A small language model's targets are padded with ``-100`` (each sample keeps 0 to 6 of its
6 tokens), and the built-in ``cross_entropy`` is the mean over the kept tokens. One
process's loss on the global batch is the mean over every kept token of it; a rank's mean
weighted by its samples is not its part of that where shares keep different numbers of
tokens per sample. The layouts weight each part by its kept tokens over the global batch's
(``strategies.items``: one scalar all-reduce a step), so the parameters after the run match
``reference_train`` (one process, the global batch in one pass) within ``ATOL`` (see
test_strategies.py for why it holds), at unequal shares, micro-batches and pipelines with
dp, zero1 and zero3 inside. Without the weighting the same runs differ by > 100 x ATOL
(checked here too, on a loss without ``count_items``). An evaluation's mean is the mean
over the evaluation batch's kept tokens as well.

Processes: a pool of 4 spawned gloo workers (``tests/mp_harness.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.config.code import loss_function
from elastic.data import StepSampler, fetch_batch, share_bounds
from elastic.reference import build_model, reference_train
from strategies import Runtime, StrategySpec, registry
from tests.integration.test_strategies import ATOL, SEED, _Pool, make_adam, max_param_diff, pp

V, T, STEPS = 11, 6, 6
CE = loss_function("cross_entropy")


def make_lm() -> nn.Sequential:
    """Per-token logits: [B, T] token ids -> [B, T, V]."""
    return nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, V))


class Padded:
    """Token sequences; sample i keeps its first ``i % 7`` targets (0 to 6), the rest -100."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(4321)
        self.x = torch.randint(0, V, (n, T), generator=g)
        self.y = torch.randint(0, V, (n, T), generator=g)
        keep = torch.arange(n) % 7
        self.y[torch.arange(T)[None, :] >= keep[:, None]] = -100

    def __len__(self) -> int:
        return len(self.x)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


DATA = Padded()


def per_sample_ce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The built-in loss without ``count_items``: weighted by samples, as before the fix."""
    return CE(outputs, targets)


def _train(name: str, spec_kw: dict[str, Any], loss: Any, data: Any = DATA) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = StrategySpec(name=name, world_size=world, **spec_kw)
    model = build_model(make_lm, SEED)
    cls = registry.get(name)
    cls.validate(spec, model)
    strat = cls(spec, Runtime.current("cpu"), model, make_adam, loss)
    sampler = StepSampler(len(data), spec.global_batch_size, SEED)
    lo, hi = share_bounds(spec.shares, rank)
    losses = []
    for s in range(STEPS):
        x, y = fetch_batch(data, sampler.indices(s))
        losses.append(strat.train_step(x[lo:hi], y[lo:hi]))
    # one evaluation batch (the step-0 batch), split as training splits it
    x, y = fetch_batch(data, sampler.indices(0))
    scored = strat.eval_step(x[lo:hi], y[lo:hi])
    out = strat.full_state()
    strat.close()
    return {"state": out if rank == 0 else None, "losses": losses, "eval": scored}


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    return reference_train(make_lm, make_adam, CE, DATA, 8, STEPS, SEED)


@pytest.fixture(scope="module")
def pool():
    p = _Pool()
    yield p
    p.close()


@pytest.fixture(scope="module")
def ref():
    return _reference()


CASES = {
    "dp-2": ("dp", 2, dict(shares=(5, 3))),
    "dp-3-micro": ("dp", 3, dict(shares=(3, 3, 2), options={"micro_batch_size": 2})),
    "zero1-3": ("zero1", 3, dict(shares=(3, 3, 2))),
    "zero2-2-micro": ("zero2", 2, dict(shares=(5, 3), options={"micro_batch_size": 2})),
    "zero3-2-micro": ("zero3", 2, dict(shares=(5, 3), options={"micro_batch_size": 2})),
    "pp2-gpipe": ("pipeline", 2, pp(2, (5, 3), 2, "gpipe")),
    "pp2-1f1b": ("pipeline", 2, pp(2, (4, 4), 4, "1f1b")),
    "pp2xdp2": ("pipeline", 4, pp(2, (4, 1, 2, 1), 2, "gpipe", "dp")),
    "pp2xzero3": ("pipeline", 4, pp(2, (4, 1, 2, 1), 2, "gpipe", "zero3")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_token_mean_loss_trains_what_one_process_trains(pool: _Pool, ref: Any,
                                                          case: str) -> None:
    name, world, kw = CASES[case]
    results = pool.run(_train, name, kw, CE, world_size=world)
    state, losses = ref
    assert max_param_diff(results[0]["state"], state) < ATOL
    # the losses the ranks return add up to one process's loss of each step
    got = [sum(r["losses"][s] for r in results) for s in range(STEPS)]
    assert got == pytest.approx(losses, rel=1e-5, abs=1e-6)
    # an evaluation's (loss x items, items) add up to the mean over the batch's kept tokens
    x, y = fetch_batch(DATA, StepSampler(len(DATA), 8, SEED).indices(0))
    kept = int((y != -100).sum())
    value, items = (sum(r["eval"][i] for r in results) for i in (0, 1))
    model = build_model(make_lm, SEED)
    model.load_state_dict({k[len("model/"):]: v for k, v in results[0]["state"].items()
                           if k.startswith("model/")})
    with torch.no_grad():
        want = float(CE(model(x), y))
    assert items == kept and value / items == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("case", ["dp-2", "pp2xdp2"])
def test_weighted_by_samples_the_same_runs_differ(pool: _Pool, ref: Any, case: str) -> None:
    """What the weighting changes: a loss that does not count its items is weighted by
    samples, and these shares then train another model (the test above can fail)."""
    name, world, kw = CASES[case]
    results = pool.run(_train, name, kw, per_sample_ce, world_size=world)
    assert max_param_diff(results[0]["state"], ref[0]) > 100 * ATOL


class _Masked:
    """``Padded``'s tokens with float targets, NaN where a target is padding."""

    def __len__(self) -> int:
        return len(DATA)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = DATA.get_batch(idx)
        return x, torch.where(y == -100, torch.nan, y.float() / V)


def masked_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss: the mean squared error over the targets that are not NaN (0 for none)."""
    kept = ~torch.isnan(targets)
    err = (outputs[..., 0] - torch.nan_to_num(targets)) ** 2
    return (err * kept).sum() / kept.sum().clamp(min=1)


masked_mse.count_items = lambda targets: (~torch.isnan(targets)).sum()  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", ["dp-2", "zero3-2-micro", "pp2-gpipe"])
def test_a_user_loss_that_counts_its_items_trains_what_one_process_trains(pool: _Pool,
                                                                           case: str) -> None:
    """A loss of the user's own with a ``count_items`` attribute (a masked regression) is
    weighted by its items as the built-in one is."""
    name, world, kw = CASES[case]
    results = pool.run(_train, name, kw, masked_mse, _Masked(), world_size=world)
    want, _ = reference_train(make_lm, make_adam, masked_mse, _Masked(), 8, STEPS, SEED)
    assert max_param_diff(results[0]["state"], want) < ATOL
