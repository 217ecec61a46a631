"""The live controller's closed loop (``elastic.control.replan.Replanner``) on the figures the
workers report, without Ray: what it hands the policy is what the re-fit and the straggler
check need (the policy and the re-fit are tested over their tables in
``test_clusters_measured.py`` and ``test_policies.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from clusters.measured import terms_model
from clusters.refit import fixed_per_sample, stage_fractions
from elastic.control.replan import Replanner
from elastic.planning import spec_plan
from strategies import StrategySpec
from tests.unit.test_clusters_measured import _base, _live, _reports


def _loop() -> tuple[Replanner, Any, list[tuple[str, str, dict[str, Any]]], list[float]]:
    cluster, ids = _live()
    mm = terms_model(_reports(), ids, _base(), cluster=cluster)
    cfg = SimpleNamespace(replan_every=20, strategy="auto", balance="auto", max_steps=10_000,
                          global_batch_size=64, strategy_options=dict)
    layouts = SimpleNamespace(measured=mm, cluster=cluster, ids=ids, kinds=["cpu", "cpu"],
                              probe_model=None, apply_s=[0.5], rebalanced=lambda *a: None)
    events: list[tuple[str, str, dict[str, Any]]] = []

    def emit(kind: str, msg: str, data: dict[str, Any] | None = None, step: int = 0) -> None:
        events.append((kind, msg, data or {}))

    c = [mm.model.seconds_per_sample[i] for i in ids]
    return Replanner(cfg, layouts, emit), mm, events, c


def _group(n: int = 2) -> Any:
    return SimpleNamespace(workers=[SimpleNamespace(worker_id=f"w{r}") for r in range(n)])


def _dp(rp: Replanner, mm: Any) -> tuple[StrategySpec, float, Any]:
    """dp on the loop's two ranks, the model's step for it, and their group."""
    spec = StrategySpec("dp", world_size=2, shares=(32, 32))
    step = mm.model.estimate(spec_plan(spec, rp.layouts.ids, None), rp.layouts.cluster,
                             mm.profile).step_time
    return spec, step, _group()


def _at_layout(rp: Replanner, mm: Any, spec: StrategySpec) -> list[float]:
    """The model's figure per sample of each rank at ``spec``: its work and its fixed costs
    per pass over its share (``refit.fixed_per_sample``), what the live figures are taken to."""
    plan = spec_plan(spec, rp.layouts.ids, None)
    fixed = fixed_per_sample(plan, mm.model, mm.profile, rp.layouts.cluster)
    return [mm.model.seconds_per_sample[i] + f for i, f in zip(rp.layouts.ids, fixed, strict=True)]


def _feed(rp: Replanner, spec: StrategySpec, steps: range, step_s: float,
          rank_s_per_sample: list[float], frac: float) -> None:
    """Each rank's metric for each step, as the workers report them: the seconds inside the
    blocks' forwards (``compute_s``) for its share of the batch."""
    for s in steps:
        for r, t in enumerate(rank_s_per_sample):
            n = spec.shares[r]
            rp.on_metric({"step": s, "rank": r, "step_time": step_s if r == 0 else None,
                          "compute_s": t * frac * n, "samples": n}, spec)


def test_the_live_compute_reaches_the_policy_on_the_models_scale_and_a_later_straggler_shows():
    """The workers' forward seconds come out 2.1x the model's compute (as on a small GPT on 3
    CPU ranks): the first window is taken to the model's scale, and a rank that slows 3x
    later shows 3x slower, its peer where it was, and is named."""
    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    _feed(rp, spec, range(0, 30), step, [2.1 * t for t in c], frac)
    rp.decide(30, spec, group)
    (kind, _, data), = events
    assert kind == "replan"
    have = _at_layout(rp, mm, spec)
    assert data["rank_s_per_sample"] == pytest.approx(have, rel=1e-6)
    _feed(rp, spec, range(30, 60), step * 1.5, [2.1 * c[0], 3 * 2.1 * c[1]], frac)
    rp.decide(60, spec, group)
    assert events[-2][0] == "replan"
    assert events[-2][2]["rank_s_per_sample"] == pytest.approx([have[0], 3 * have[1]], rel=1e-6)
    kind, msg, data = events[-1]
    assert kind == "straggler" and data["ranks"] == [1] and data["workers"] == ["w1"], msg


def test_a_decision_with_a_straggler_observes_once_and_counts_the_hosts_drift_once(monkeypatch):
    """While a straggler is named, the re-fit's point of the layout is the ranks' span: the
    loop names it from the ranks' figures first and builds the observation once. Was: it
    built one, found the straggler in it, and built another, a planner call more at every
    decision and the window's drift counted twice in ``LoopMemory.drifts``."""
    import clusters.refit

    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    seen: list[Any] = []
    real = clusters.refit.observe
    monkeypatch.setattr(clusters.refit, "observe", lambda **kw: seen.append(kw) or real(**kw))
    _feed(rp, spec, range(0, 60), step, [c[0], 3 * c[1]], frac)
    rp.decide(30, spec, group)
    assert len(seen) == 1 and seen[0]["recent"] is not None  # rank 1 named: its span
    assert len(rp.memory.drifts) <= 1 and rp._named == ("w1",)


def test_a_pipeline_rank_slowed_before_the_first_decision_is_named():
    """A pp2 pipeline whose rank 1 computes 6x slower from step 30, the first decision made
    only at step 60 (the controller's poll and the drained metrics lag the workers' steps on
    fast steps): the ranks' footing is the layout's first steps, so rank 1 reads 6x its
    stage's figure and is named. Was: the footing was the first decision's own span, already
    slow, rank 1 read as its stage and was never named (a live pp2 job ran its 3000 steps
    without a re-split in two full suite runs)."""
    rp, mm, events, c = _loop()
    rp.layouts._block_costs = lambda group: [0.2, 0.6, 0.2]  # noqa: SLF001
    frac = mm.spreads["forward_fraction"]
    spec = StrategySpec("pipeline", 2, (32, 32), pp_degree=2, micro_batches=4,
                        schedule="1f1b", stage_split=(2, 1))
    group = _group()
    _feed(rp, spec, range(0, 30), 0.01, [c[0] * 0.8, c[1] * 0.2], frac)
    _feed(rp, spec, range(30, 60), 0.02, [c[0] * 0.8, 6 * c[1] * 0.2], frac)
    rp.decide(60, spec, group)
    replan = next(d for k, _, d in events if k == "replan")
    assert replan["rank_s_per_sample"][1] == pytest.approx(6 * replan["rank_s_per_sample"][0])
    strag = [(m, d) for k, m, d in events if k == "straggler"]
    assert strag and strag[0][1]["ranks"] == [1], events


def test_a_long_layout_keeps_a_bounded_window_and_its_first_steps():
    """A layout that runs for 100,000 steps: the loop keeps its first steps (the ranks'
    footing) and its last (the window), not every step (was ~8M entries at 1M steps on 8
    ranks, all sorted at each decision); its decision reads the same figures."""
    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec = StrategySpec("dp", world_size=2, shares=(32, 32))
    _feed(rp, spec, range(0, 100_000), 0.01, [c[0], c[1]], frac)
    assert len(rp._steps) < 600 and all(len(d) < 600 for d in rp._ranks.values())  # noqa: SLF001
    assert min(rp._steps) == 0 and max(rp._steps) == 99_999  # noqa: SLF001
    group = _group()
    rp.decide(100_000, spec, group)
    (kind, _, data), = events
    assert data["steps"] == 200 and data["rank_s_per_sample"] == pytest.approx(
        _at_layout(rp, mm, spec), rel=1e-6)


def test_a_pipeline_entered_with_a_known_straggler_names_it_and_re_splits():
    """Rank 1 computes 6x slower under dp (named there, its share re-cut), then the job
    moves to a pp2 pipeline (a user's switch, or ``auto`` finding pp2 faster): the
    pipeline's first steps are slow already. Its footing takes rank 1's known slowness out,
    so rank 1 reads ~6x its stage's figure and the stage split is re-cut off it. Was: the
    footing was the slow first steps, rank 1 read as its stage's norm, and a split with
    more blocks on rank 1 than on rank 0 ran on (two live auto jobs in 28: 2800 steps)."""
    rp, mm, events, c = _loop()
    rp.layouts._block_costs = lambda group: [0.2, 0.6, 0.2]  # noqa: SLF001
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    _feed(rp, spec, range(0, 30), step * 3, [c[0], 6 * c[1]], frac)
    rp.decide(30, spec, group)
    assert [d["ranks"] for k, _, d in events if k == "straggler"] == [[1]]
    pipe = StrategySpec("pipeline", 2, (32, 32), pp_degree=2, micro_batches=4,
                        schedule="1f1b", stage_split=(1, 2))
    _feed(rp, pipe, range(30, 60), 0.05, [c[0] * 0.2, 6 * c[1] * 0.8], frac)
    new = rp.decide(60, pipe, group)
    replan = [d for k, _, d in events if k == "replan"][-1]
    rel = replan["rank_s_per_sample"]
    assert rel[1] == pytest.approx(6 * rel[0], rel=0.05), rel
    # the re-split itself, or a switch that carries it (another pipeline on the split
    # that follows the stages' times: rank 1 6x slower is so in the model too)
    assert replan["cut"] == "stage split" and replan["recut"] == [2, 1], replan
    assert replan["decision"] in ("RecutShares", "SwitchPlan"), replan
    assert new is not None and new.name == "pipeline" and new.stage_split == (2, 1)
    # the re-split runs (rank 1 now on the light block, its stage's norm there): still
    # known 6x slower, for whatever pipeline comes next
    _feed(rp, new, range(60, 90), 0.02, [c[0] * 0.8, 6 * c[1] * 0.2], frac)
    rp.decide(90, new, group)
    assert rp._slow_by["w1"] == pytest.approx(6, rel=0.05)  # noqa: SLF001


def test_a_re_cut_around_a_rank_that_just_slowed_predicts_from_the_step_now():
    """Rank 1 slows 6x after 100 steps; the decision 20 steps later sees its compute over
    those 20 and re-cuts its share. The step the re-cut saves from is the step over the
    same 20 steps, not the window's median (mostly from before it slowed). Was: the saving
    (on the slow steps) came off the fast median: "predicted -4.3 ms/step against 12.4 ms
    measured" in a live job's event."""
    import re

    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    _feed(rp, spec, range(0, 100), step, [c[0], c[1]], frac)
    slow_step = step + 31 * c[1] * 5  # rank 1's 32 samples, 6x: the step waits on them
    _feed(rp, spec, range(100, 120), slow_step, [c[0], 6 * c[1]], frac)
    rp.decide(120, spec, group)
    replan = [(m, d) for k, m, d in events if k == "replan"][-1]
    msg, data = replan
    assert data["decision"] == "RecutShares", msg
    assert data["step_s"] == pytest.approx(slow_step) and data["steps"] == 20
    predicted = float(re.search(r"predicted (-?[\d.]+) ms/step", msg).group(1))
    assert 0 < predicted < slow_step * 1e3, msg


def test_a_straggler_that_slows_further_drops_the_figures_of_before(monkeypatch):
    """Rank 1, named at 2x, slows to 6x at the same layout: its compute there moved, so the
    other layouts' figures (of before) are dropped as for a newly named straggler (was:
    kept, and a layout measured before was switched to on them: the simulator's test)."""
    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    forgot: list[Any] = []
    real = rp._forget_others  # noqa: SLF001
    monkeypatch.setattr(rp, "_forget_others", lambda cur: forgot.append(cur) or real(cur))
    _feed(rp, spec, range(0, 30), step * 2, [c[0], 2 * c[1]], frac)
    rp.decide(30, spec, group)
    assert len(forgot) == 1  # newly named
    _feed(rp, spec, range(30, 60), step * 2, [c[0], 2.1 * c[1]], frac)
    rp.decide(60, spec, group)
    assert len(forgot) == 1  # the same straggler, within the noise
    _feed(rp, spec, range(60, 90), step * 6, [c[0], 6 * c[1]], frac)
    rp.decide(90, spec, group)
    assert len(forgot) == 2  # it moved: 6x where it read 2x


def test_a_label_keeps_the_figure_of_the_shares_it_ran_last():
    """dp ran at [32, 32] (its straggler just slowed), then at the re-cut [60, 4], then the
    loop tried zero1: dp's figure, and the plan the way back goes to, are the re-cut's.
    Was: both kept, and the way back took the lower figure's plan, [32, 32] measured right
    after the slowdown (a new user's 3-rank click model: "back ... against dp's 16.2 ms",
    then dp at [32, 32, 32] to the end, the straggler's share whole)."""
    rp, mm, events, c = _loop()
    frac = mm.spreads["forward_fraction"]
    spec, step, group = _dp(rp, mm)
    _feed(rp, spec, range(0, 30), step, [c[0], 6 * c[1]], frac)
    recut = StrategySpec("dp", world_size=2, shares=(60, 4))
    _feed(rp, recut, range(30, 60), step * 1.1, [c[0], 6 * c[1]], frac)
    zero1 = StrategySpec("zero1", world_size=2, shares=(60, 4))
    _feed(rp, zero1, range(60, 61), step, [c[0], 6 * c[1]], frac)
    dps = [p for p, _ in rp.observed.values() if p.label == "dp"]
    assert [p.shares for p in dps] == [(60, 4)]


def test_a_pipeline_whose_rank_is_slow_from_its_first_steps_names_it_and_re_splits():
    """A pp2 pipeline whose rank 1 runs 6x slower than the model from its first steps, no
    straggler named before it: its footing (the first steps) would take that pace for its
    stage's norm. The live scale leaves the rank out (more than 50 % slower against the
    model than the other stage), and the footing takes that slowness out, as a known
    straggler's: rank 1 reads ~6x its stage and the split is cut off it. Was: never named,
    never re-split (a new user's run entered pp2 with an unnamed straggler)."""
    rp, mm, events, c = _loop()
    rp.layouts._block_costs = lambda group: [0.2, 0.6, 0.2]  # noqa: SLF001
    frac = mm.spreads["forward_fraction"]
    group = _group()
    pipe = StrategySpec("pipeline", 2, (32, 32), pp_degree=2, micro_batches=4,
                        schedule="1f1b", stage_split=(1, 2))
    plan = spec_plan(pipe, rp.layouts.ids, None)
    have = [h * f for h, f in zip(_at_layout(rp, mm, pipe), stage_fractions(
        plan, mm.profile, rp.layouts.cluster), strict=True)]  # each stage's model figure
    _feed(rp, pipe, range(0, 30), 0.05, [have[0], 6 * have[1]], frac)
    rp.decide(30, pipe, group)
    replan = [d for k, _, d in events if k == "replan"][-1]
    assert [d["ranks"] for k, _, d in events if k == "straggler"] == [[1]], events
    assert replan["rank_s_per_sample"][1] == pytest.approx(6, rel=0.05), replan
    assert replan["cut"] == "stage split" and replan["recut"] == [2, 1], replan
