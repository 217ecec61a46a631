"""Heterogeneous workers (emulated here: a slowdown and a memory budget per worker): batch
shares follow measured speed with the gradient still the exact mean over G, and
``strategy="auto"`` lets the planner choose under each worker's memory."""

from __future__ import annotations

import elastic
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

G = 14
TOL = 1e-5


def _cfg(tmp_path, **kw):
    base = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
                max_steps=10, num_workers=3, view="none", run_dir=str(tmp_path / "run"))
    base.update(kw)
    return base


def test_shares_follow_measured_speed_and_training_is_unchanged(ray_local, tmp_path):
    result = elastic.fit(**_cfg(tmp_path, emulate=[{"slowdown": 1}, {"slowdown": 1},
                                                   {"slowdown": 4, "stands_for": "T4"}]))
    layout = next(e for e in result.events if e.kind == "layout")
    shares = layout.message.split("shares ")[1].split(" (")[0]
    s = [int(x) for x in shares.strip("[]").split(",")]
    assert sum(s) == G and s[2] < s[0] and s[2] < s[1], s
    assert any(e.kind == "profiled" for e in result.events)
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 10, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL


def test_auto_strategy_respects_memory_budgets(ray_local, tmp_path):
    # ~650 parameters: dp needs ~10 KB per worker for params, grads and Adam state; a 7 KB
    # budget (6.3 KB usable) rules out dp and zero1, so the planner must shard more.
    budget = {"memory_gb": 7e-6, "stands_for": "tiny"}
    result = elastic.fit(**_cfg(tmp_path, strategy="auto", emulate=[budget] * 3))
    plan = next(e for e in result.events if e.kind == "plan")
    chosen = result.history[-1]["strategy"]
    assert chosen in ("zero2", "zero3", "pipeline"), plan.data["explanation"]
    assert "dp" in plan.data["explanation"] and "rejected" in plan.data["explanation"].lower()
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 10, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL
