"""Models whose forward leaves trainable parameters out: a head the loss never reads, a
branch only some samples take (an MoE expert, a data-dependent path).

dp needs DDP's ``find_unused_parameters`` for them (preflight turns it on where a training
pass on a few samples leaves any out); without it the step's check names the setting instead
of applying unreduced gradients (was: the next step's forward raised inside DDP, read as the
group failing: recoveries, then "the same failure came back"). zero3 needs it where ranks
differ in what they use (FSDP2's ``set_reduce_scatter_unused_params``). zero1 and zero2 take
such models as they are. Against one process's AdamW steps over the same global batches: a
parameter no sample of a step used keeps no gradient there and is skipped by the optimizer,
as in one process (weight decay included). Tolerance 1e-6: only the order of the float
additions of the gradient sums differs.

Two spawned gloo processes (``tests/mp_harness.py``), no Ray.
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
STEPS = 4


class Branchy(nn.Module):
    """``aux`` is never used; ``extra`` only for samples whose first feature is above
    ``thr`` (with thr 1.0 and these batches, some steps one rank takes it and the other
    does not)."""

    def __init__(self, thr: float) -> None:
        super().__init__()
        self.body, self.extra = nn.Linear(8, 12), nn.Linear(8, 12)
        self.aux, self.head = nn.Linear(12, 5), nn.Linear(12, 3)
        self.thr = thr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        m = x[:, 0] > self.thr
        if m.any():
            h = h + self.extra(x) * m[:, None].to(h.dtype)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(sum(SHARES), 8, generator=g), torch.randn(sum(SHARES), 3, generator=g)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(thr: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy(thr)
    opt = _adamw(model.parameters())
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(name: str, thr: float, find_unused: bool) -> Any:
    """Runs on every rank: the worst parameter difference from one process, or the error."""
    from strategies import Runtime, StrategySpec, registry
    from strategies.spec import StrategyOptions

    torch.manual_seed(0)
    model = Branchy(thr)
    spec = StrategySpec(name=name, world_size=dist.get_world_size(), shares=SHARES,
                        options=StrategyOptions(find_unused_parameters=find_unused))
    cls = registry.get(name)
    cls.validate(spec, model)
    strat = cls(spec, Runtime.current("cpu"), model, _adamw, F.mse_loss)
    r = dist.get_rank()
    lo, hi = sum(SHARES[:r]), sum(SHARES[:r + 1])
    used = []
    try:
        for s in range(STEPS):
            x, y = _batch(s)
            used.append(bool((x[lo:hi, 0] > thr).any()))
            strat.train_step(x[lo:hi], y[lo:hi])
        state = strat.full_state()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": e, "used": used}
    finally:
        strat.close() if hasattr(strat, "close") else None
    want = _reference(thr)
    return {"diff": max(float((state[f"model/{k}"] - v).abs().max()) for k, v in want.items()),
            "used": used}


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPool]:
    p = ProcessPool(2, group_timeout_s=30)
    yield p
    p.close()


@pytest.mark.parametrize("name,thr", [("dp", 1e9), ("dp", 1.0), ("zero1", 1.0), ("zero2", 1.0),
                                      ("zero3", 1e9), ("zero3", 1.0)])
def test_a_model_that_leaves_parameters_out_trains_as_one_process(pool, name, thr):
    """zero3 with ``find_unused_parameters``: FSDP2 reduce-scatters zeros where a rank's
    forward left a parameter out (was: the ranks' reduce-scatters differed in size and gloo
    aborted the process), and a gradient no rank made is dropped before the update."""
    out = pool.run(_train, name, thr, name in ("dp", "zero3"), world_size=2, timeout_s=300)
    for rank in out:
        assert "error" not in rank, rank.get("error")
        assert rank["diff"] < 1e-6, rank
    if thr == 1.0:  # the branch: taken by one rank and not the other in some step
        assert any(a != b for a, b in zip(out[0]["used"], out[1]["used"], strict=True))


def test_zero3_without_find_unused_parameters_takes_ranks_that_differ(pool):
    """The branch taken by one rank and not the other, the setting off (a branch the sample
    check missed): FSDP2 reduce-scatters zeros where a rank left it out, so the step runs
    (was: gloo aborted the worker process). Where no rank used a parameter, it is stepped
    with a zero gradient there (AdamW decays it): not one process's value, said in
    docs/reliability.md."""
    out = pool.run(_train, "zero3", 1.0, False, world_size=2, timeout_s=300)
    for rank in out:
        assert "error" not in rank, rank.get("error")
        assert rank["diff"] < 0.1, rank  # (aux, never used, decayed: ~lr * wd * |w| a step)


def test_dp_without_find_unused_parameters_names_the_setting(pool):
    """Each rank's step refuses at once, naming ``find_unused_parameters`` and the
    parameters left out; a worker reports it as that setting's error. Was: the update of
    unreduced gradients applied, then DDP's error in the next forward, read as the group
    failing."""
    from elastic.errors import ConfigError
    from elastic.failures import worker_error

    out = pool.run(_train, "dp", 1e9, False, world_size=2, timeout_s=300)
    for r, rank in enumerate(out):
        e = rank["error"]
        assert getattr(e, "setting", None) == "find_unused_parameters", e
        assert "aux.weight" in str(e) and "find_unused_parameters: true" in str(e)
        said = worker_error(e, r)
        assert isinstance(said, ConfigError) and said.field == "find_unused_parameters"
        assert said.fix.startswith("set find_unused_parameters: true"), said.fix


def _nan_step() -> bool:
    """Runs on every rank: zero3 with find_unused_parameters, a step whose inputs are NaN:
    whether every trainable parameter still has its (non-finite) gradient for the step's
    non-finite check."""
    from strategies import Runtime, StrategySpec, registry
    from strategies.spec import StrategyOptions

    torch.manual_seed(0)
    model = Branchy(1e9)
    spec = StrategySpec(name="zero3", world_size=dist.get_world_size(), shares=SHARES,
                        options=StrategyOptions(find_unused_parameters=True))
    strat = registry.get("zero3")(spec, Runtime.current("cpu"), model, _adamw, F.mse_loss)
    x, y = _batch(0)
    x = torch.full_like(x, float("nan"))
    strat.train_step(x[:4], y[:4])
    used = [p for n, p in model.named_parameters() if not n.startswith(("aux", "extra"))]
    kept = all(p.grad is not None for p in used)
    strat.close()
    return kept


def test_zero3_keeps_a_nan_gradient_for_the_non_finite_check(pool):
    """A NaN gradient is not taken for one no rank made (NaN != 0): the step's non-finite
    check still sees it (found by review, session 47: ``abs().sum() > 0`` is False for NaN,
    so the gradients were dropped and the step not marked skipped)."""
    assert pool.run(_nan_step, world_size=2, timeout_s=300) == [True, True]
