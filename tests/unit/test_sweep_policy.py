"""Sweeps' pure decisions: where the pruner can decide (so a trial's workers wait there and
nowhere else), and how many workers a promoted trial gets (clusters.sweep_policy), over
their tables; the pruning steps are checked against Optuna's own pruners."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import optuna
import pytest

from clusters.sweep_policy import (
    GateObservation,
    GatePolicy,
    GoOn,
    Grow,
    PromotionObservation,
    PromotionPolicy,
    Prune,
    PruneGate,
    Stay,
    simulate_halving,
)
from elastic.errors import ConfigError
from elastic.sweep import load_sweep
from elastic.sweep.gates import best_of, gate_for, halving_gate
from elastic.sweep.pruning import PruneSteps
from elastic.sweep.study import make_pruner
from elastic.sweep.sweep_file import SweepConfig
from elastic.sweep.trial_steps import TrialSteps


@pytest.mark.parametrize("spec, steps", [
    ({"type": "none"}, []),
    ({"type": "median"}, list(range(20))),
    ({"type": "median", "n_warmup_steps": 5}, list(range(5, 20))),
    ({"type": "median", "n_warmup_steps": 3, "interval_steps": 4}, [3, 7, 11, 15, 19]),
    ({"type": "hyperband"}, [1, 3, 9]),
    ({"type": "hyperband", "min_resource": 2, "reduction_factor": 2}, [2, 4, 8, 16]),
    ({"type": "hyperband", "min_resource": "auto"}, list(range(20))),  # unknown: every step
])
def test_decision_steps_table(spec, steps):
    p = PruneSteps.of(spec)
    assert [s for s in range(20) if p.decides_at(s)] == steps
    for s in range(20):  # next_at is the first decision step at or after s
        later = [x for x in steps if x >= s]
        want = later[0] if later else None
        got = p.next_at(s)
        assert got == want or (not later and (got is None or got >= 20)), (s, got, want)


def _prune_step(pruner_spec: dict, curves: list[list[float]], ask=lambda step: True,
                direction: str = "minimize") -> list[int | None]:
    """Run trials with these loss curves through Optuna (in memory): each reports every
    step and asks ``should_prune`` where ``ask(step)``; the step each was pruned at."""
    cfg = SweepConfig(base={"max_steps": len(curves[0])}, params={}, pruner=pruner_spec)
    study = optuna.create_study(study_name="s", pruner=make_pruner(cfg), direction=direction)
    out: list[int | None] = []
    for curve in curves:
        trial = study.ask()
        at = None
        for step, v in enumerate(curve):
            trial.report(v, step)
            if ask(step) and trial.should_prune():
                at = step
                break
        if at is None:
            study.tell(trial, curve[-1])
        else:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        out.append(at)
    return out


@pytest.mark.parametrize("spec", [
    {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 3},
    {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 2, "interval_steps": 3},
    {"type": "hyperband", "min_resource": 1, "reduction_factor": 3},
    {"type": "hyperband", "min_resource": 2, "reduction_factor": 2},
])
def test_asking_only_at_decision_steps_prunes_as_asking_at_every_step(spec):
    rng = random.Random(7)
    curves = [[rng.uniform(0.5, 2.0) / (1 + s * rng.uniform(0.01, 0.3)) for s in range(30)]
              for _ in range(12)]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    every = _prune_step(spec, curves, lambda s: True)
    steps = PruneSteps.of(spec)
    assert _prune_step(spec, curves, steps.decides_at) == every
    assert any(at is not None for at in every)  # the table is exercised: some are pruned


@pytest.mark.parametrize("obs, decision", [
    # rung 1 doubles a 1-worker trial
    (PromotionObservation(1, 1, 1, 1, 8), Grow(2, "")),
    (PromotionObservation(2, 2, 1, 1, 8), Grow(4, "")),
    # capped by max_workers; already there: stay
    (PromotionObservation(3, 4, 1, 1, 4), Stay("")),
    (PromotionObservation(3, 2, 1, 1, 3), Grow(3, "")),
    # capped by what is free
    (PromotionObservation(2, 1, 1, 1, 8, free=1), Grow(2, "")),
    (PromotionObservation(2, 1, 1, 1, 8, free=0), Stay("")),
    # never shrinks (a trial scaled up by someone else keeps its size)
    (PromotionObservation(1, 6, 1, 1, 8), Stay("")),
    # min_workers floor; rung 0 is the start
    (PromotionObservation(0, 2, 2, 2, 8), Stay("")),
    (PromotionObservation(1, 2, 2, 2, 8), Grow(4, "")),
])
def test_promotion_policy_table(obs, decision):
    d = PromotionPolicy(2.0).decide(obs)
    assert type(d) is type(decision)
    if isinstance(d, Grow):
        assert d.n == decision.n and f"rung {obs.rung}" in d.reason
    assert d.reason


def test_growth_one_never_grows():
    policy = PromotionPolicy(1.0)
    for rung in range(5):
        assert isinstance(policy.decide(PromotionObservation(rung, 1, 1, 1, 8)), Stay)


def test_simulated_halving_with_growth_finishes_sooner_on_the_same_cluster():
    rng = random.Random(3)
    scores = [rng.random() for _ in range(27)]
    kw = dict(steps=81, step_s=0.1, min_resource=1, reduction_factor=3, capacity=8, start=1,
              max_workers=8)
    flat = simulate_halving(scores, policy=PromotionPolicy(1.0), **kw)
    grown = simulate_halving(scores, policy=PromotionPolicy(3.0), **kw)
    assert flat.sizes.count(1) == 27
    assert max(grown.sizes) == 8  # the last trial standing reaches the cap
    assert grown.seconds < 0.6 * flat.seconds
    # workers are not free: a step on n workers is 1 + (n-1)*0.9 times faster, so a little more
    # worker time in all
    assert flat.worker_seconds < grown.worker_seconds < 1.2 * flat.worker_seconds


def _sweep(**kw) -> dict:
    data = {"study": {"name": "t", "pruner": {"type": "hyperband", "min_resource": 2}},
            "base": {"model": "tests.helpers:mlp", "optimizer": {"name": "adam", "lr": 0.01},
                     "loss": "mse", "dataset": "tests.helpers:RegressionData",
                     "global_batch_size": 8, "max_steps": 20, "num_workers": 1,
                     "max_workers": 4},
            "params": {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 0.1}}}
    data.update(kw)
    return data


def test_promotion_settings_are_checked():
    assert load_sweep(_sweep(promotion={"growth": 2})).promotion == 2
    bad = [(_sweep(promotion={"growth": 0.5}), "promotion"),
           (_sweep(promotion={"grow": 2}), "promotion"),
           ({**_sweep(promotion={"growth": 2}), "study": {"name": "t", "pruner": "median"}},
            "promotion"),
           ({**_sweep(promotion=2), "base": {**_sweep()["base"], "max_workers": None}},
            "promotion"),
           (_sweep(scheduler=""), "scheduler"),
           (_sweep(promotion={"growth": 2}, scheduler="lab"), "promotion")]
    for data, field in bad:
        with pytest.raises(ConfigError) as e:
            load_sweep(data)
        assert e.value.field == field and e.value.fix


def test_pruning_mode_is_checked():
    assert load_sweep(_sweep()).exact_pruning is False  # the default: no pause
    assert load_sweep(_sweep(pruning={"exact": True})).exact_pruning is True
    assert load_sweep(_sweep(pruning={"exact": False})).exact_pruning is False
    bad = [(_sweep(pruning={"exact": "yes"}), "pruning.exact"),
           (_sweep(pruning={"exact": 1}), "pruning.exact"),
           (_sweep(pruning={"pause": True}), "pruning.pause"),
           (_sweep(pruning=True), "pruning")]
    for data, field in bad:
        with pytest.raises(ConfigError) as e:
            load_sweep(data)
        assert e.value.field == field and e.value.fix, (field, e.value)


@pytest.mark.parametrize("pruner, field", [
    ({"type": "hyperband", "min_resource": "auto"}, "study.pruner.min_resource"),
    ({"type": "hyperband", "min_resource": 0}, "study.pruner.min_resource"),
    ({"type": "hyperband", "min_resource": 2.5}, "study.pruner.min_resource"),
    ({"type": "hyperband", "reduction_factor": 1}, "study.pruner.reduction_factor"),
    ({"type": "hyperband", "reduction_factor": "3"}, "study.pruner.reduction_factor"),
    ({"type": "hyperband", "max_resource": 0}, "study.pruner.max_resource"),
    ({"type": "hyperband", "min_resource": 10, "max_resource": 5}, "study.pruner.max_resource"),
    ({"type": "hyperband", "min_resource": 80}, "study.pruner.min_resource"),  # > max_steps
])
def test_hyperband_settings_optuna_would_fail_on_later_are_refused_up_front(pruner, field):
    """Optuna's HyperbandPruner takes these and raises a TypeError or divides by zero at its
    first decision, mid-sweep; the sweep refuses them before any trial starts."""
    with pytest.raises(ConfigError) as e:
        make_pruner(SweepConfig(base={"max_steps": 50}, params={}, pruner=pruner))
    assert e.value.field == field and e.value.fix


def _hooked_prune_step(pruner_spec: dict, curves: list[list[float]], direction: str,
                       exact: bool, gates: list[int] | None = None
                       ) -> tuple[list[int | None], list[dict[int, float]]]:
    """As ``_prune_step``, but each trial's losses go through ``TrialSteps`` (which reports
    only what the pruner reads while the trial runs, the rest at ``finish``); the step each
    was pruned at, and each trial's stored values. With ``gates`` (a list), the workers'
    side is played too: before each step the hook's gate is taken, and at a gated step
    ``GatePolicy`` decides as the workers do, over the losses after the gate's ``through``
    (the entry then says ``gate: prune``); each step a gate pruned at goes into ``gates``."""
    cfg = SweepConfig(base={"max_steps": len(curves[0])}, params={}, pruner=pruner_spec)
    study = optuna.create_study(study_name="s", pruner=make_pruner(cfg), direction=direction)
    out: list[int | None] = []
    for curve in curves:
        trial = study.ask()
        hook = TrialSteps(trial, PruneSteps.of(pruner_spec), exact=exact)
        for step, v in enumerate(curve):
            entry = {"step": step, "loss": v, "world_size": 1}
            g = hook.gate(step) if gates is not None else None
            if g is not None and g.step == step:
                seen = tuple(curve[g.through + 1:step + 1])
                if isinstance(GatePolicy().decide(GateObservation(g, seen)), Prune):
                    entry["gate"] = "prune"
                    gates.append(step)  # type: ignore[union-attr]
            if hook.on_step(entry):
                break
        hook.finish()
        if hook.pruned_at is None:
            study.tell(trial, curve[-1])
        else:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        out.append(hook.pruned_at)
    return out, [t.intermediate_values for t in study.get_trials()]


@pytest.mark.parametrize("spec", [
    {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 3},
    {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 2, "interval_steps": 3},
    {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0, "interval_steps": 7},
    {"type": "hyperband", "min_resource": 1, "reduction_factor": 3},
    {"type": "hyperband", "min_resource": 2, "reduction_factor": 2},
    {"type": "hyperband", "min_resource": 3, "reduction_factor": 2},
])
@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_reporting_only_what_the_pruner_reads_prunes_as_reporting_every_step(spec, direction):
    """Curves that are noisy (a trial's best value is often between decision steps, where
    the median pruner reads it) and sometimes NaN: the hook's decisions, in either mode, are
    Optuna's with every step reported and the pruner asked at every step; the stored curves
    are whole (up to the decision step of a pruned trial)."""
    rng = random.Random(11)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    curves = []
    for _ in range(14):
        scale = rng.uniform(0.5, 2.0)
        curve = [scale / (1 + s * rng.uniform(0.01, 0.3)) * rng.uniform(0.6, 1.4)
                 for s in range(30)]
        if rng.random() < 0.2:
            curve[rng.randrange(30)] = float("nan")
        curves.append(curve)
    want = _prune_step(spec, curves, direction=direction)
    for exact in (False, True):
        got, values = _hooked_prune_step(spec, curves, direction, exact)
        assert got == want
        for curve, at, stored in zip(curves, got, values, strict=True):
            kept = len(curve) if at is None else at + 1
            assert sorted(stored) == list(range(kept))
            assert all(stored[s] == curve[s] or (math.isnan(stored[s]) and math.isnan(curve[s]))
                       for s in stored)
    assert any(at is not None for at in want)  # the table is exercised: some are pruned
    assert any(at is None for at in want)
    # the workers decide ahead, as the pruner would
    gated: list[int] = []
    assert _hooked_prune_step(spec, curves, direction, False, gated)[0] == want
    pruned = [at for at in want if at is not None]
    if spec["type"] == "median":
        assert gated == pruned  # every prune was the gate's
    else:  # but where another trial's value at the rung is NaN (the driver decides there)
        assert set(gated) <= set(pruned) and len(gated) >= len(pruned) // 2, (gated, pruned)


def _pruner_table() -> list[tuple[str, optuna.pruners.PercentilePruner]]:
    out: list[tuple[str, optuna.pruners.PercentilePruner]] = []
    for direction in ("minimize", "maximize"):
        out.append((direction, optuna.pruners.MedianPruner(n_startup_trials=0)))
        out.append((direction, optuna.pruners.MedianPruner(n_startup_trials=3)))
        for pct, n_min in ((25.0, 1), (75.0, 2), (0.0, 1), (100.0, 4), (50.0, 3)):
            out.append((direction, optuna.pruners.PercentilePruner(
                pct, n_startup_trials=1, n_min_trials=n_min)))
    return out


@pytest.mark.parametrize("direction, pruner", _pruner_table())
def test_the_workers_gate_decides_as_optunas_percentile_pruner(direction, pruner):
    """Random studies (complete trials with values missing or NaN at the decision step, a
    running trial whose values are partly NaN or all NaN, the driver's share and the
    workers' split anywhere): the gate's decision is ``PercentilePruner.prune``'s, and no
    gate exists where the pruner cannot prune (too few complete trials)."""
    rng = random.Random(7)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seen = {"prune": 0, "go on": 0, "no gate": 0}
    for case in range(60):
        study = optuna.create_study(direction=direction, pruner=pruner)
        for _ in range(rng.randrange(0, 6)):
            vals = {s: (math.nan if rng.random() < 0.15 else rng.uniform(0, 2))
                    for s in range(12) if rng.random() < 0.8}
            study.add_trial(optuna.trial.create_trial(value=1.0, intermediate_values=vals))
        trial = study.ask()
        step = rng.randrange(1, 12)
        nan_all = rng.random() < 0.1
        curve = [math.nan if nan_all or rng.random() < 0.2 else rng.uniform(0, 2)
                 for _ in range(step + 1)]
        for s, v in enumerate(curve):
            trial.report(v, s)
        want = pruner.prune(study, study._storage.get_trial(trial._trial_id))  # noqa: SLF001
        k = rng.randrange(0, step + 1)  # the driver has steps < k, the workers the rest
        g = gate_for(study, step, best_of(curve[:k], direction == "maximize"), k - 1,
                     version=case + 1)
        if g is None:
            assert want is False, case
            seen["no gate"] += 1
            continue
        assert g.through == k - 1 and g.version == case + 1
        d = GatePolicy().decide(GateObservation(g, tuple(curve[k:])))
        assert isinstance(d, Prune) == want, (case, g, curve, d)
        seen["prune" if want else "go on"] += 1
    assert all(seen.values()), seen  # every branch of the table is exercised


def _halving_table() -> list[Any]:
    sh, hb = optuna.pruners.SuccessiveHalvingPruner, optuna.pruners.HyperbandPruner
    out: list[Any] = []
    for direction in ("minimize", "maximize"):
        out += [pytest.param(direction, lambda: sh(min_resource=1, reduction_factor=2),
                             id=f"{direction}-sh"),
                pytest.param(direction, lambda: sh(min_resource=2, reduction_factor=3,
                                                   min_early_stopping_rate=1,
                                                   bootstrap_count=2), id=f"{direction}-sh-boot"),
                pytest.param(direction, lambda: hb(min_resource=1, max_resource=40,
                                                   reduction_factor=2), id=f"{direction}-hb"),
                pytest.param(direction, lambda: hb(min_resource=2, max_resource=60,
                                                   reduction_factor=3, bootstrap_count=1),
                             id=f"{direction}-hb-boot"),
                # brackets Optuna derives from the complete trials at its first decision
                pytest.param(direction, lambda: hb(min_resource=1, max_resource="auto",
                                                   reduction_factor=2), id=f"{direction}-hb-auto")]
    return out


@pytest.mark.parametrize("direction, make", _halving_table())
def test_the_workers_gate_decides_as_optunas_successive_halving(direction, make):
    """Random studies (other trials that reached rungs with values, some tied, some NaN,
    the trial itself at a random rung, a value at a decision step that is sometimes NaN or
    infinite): at every step where a gate exists it decides as ``pruner.prune`` then does
    (Hyperband: in the trial's own bracket); no gate where the pruner does not decide (a
    step that is not the current rung's promotion step) or where another trial's value at
    the rung is NaN. A fresh pruner per study: ``auto`` settings are derived from the
    complete trials (their last steps 0-399 here) by whichever asks first, the gate or
    ``prune``, on the same object; with no complete trial there is no gate and the pruner
    answers "go on"."""
    rng = random.Random(5)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seen = {"prune": 0, "go on": 0, "no gate": 0}
    for case in range(120):
        pruner = make()
        study = optuna.create_study(direction=direction, pruner=pruner)
        pool = [rng.uniform(0, 2) for _ in range(3)]  # drawn from: ties happen
        for _ in range(rng.randrange(0, 9)):
            attrs = {}
            for r in range(rng.randrange(0, 4)):
                attrs[f"completed_rung_{r}"] = (math.nan if rng.random() < 0.05 else
                                                rng.choice(pool + [rng.uniform(0, 2)]))
            study.add_trial(optuna.trial.create_trial(
                state=rng.choice([optuna.trial.TrialState.COMPLETE,
                                  optuna.trial.TrialState.PRUNED]),
                value=1.0, intermediate_values={rng.choice([0, 39, 150, 399]): 1.0},
                system_attrs=attrs))
        trial = study.ask()
        for r in range(rng.randrange(0, 3)):
            study._storage.set_trial_system_attr(  # noqa: SLF001
                trial._trial_id, f"completed_rung_{r}", rng.uniform(0, 2))  # noqa: SLF001
        steps = [1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 24, 27, 32]
        gated = [s for s in steps if halving_gate(study, trial._trial_id,  # noqa: SLF001
                                                  trial.number, s, 1) is not None]
        step = rng.choice(gated if gated and rng.random() < 0.8 else steps)
        u = rng.random()
        value = (math.nan if u < 0.05 else math.inf if u < 0.08
                 else rng.choice(pool + [rng.uniform(0, 2)]))
        g = halving_gate(study, trial._trial_id, trial.number, step, case + 1)  # noqa: SLF001
        trial.report(value, step)
        # a twin no gate has touched decides: what the gate derived must be what it derives
        want = make().prune(study, study._storage.get_trial(trial._trial_id))  # noqa: SLF001
        if g is None:
            seen["no gate"] += 1
            continue
        assert (g.step, g.through, g.version, g.rule) == (step, step - 1, case + 1, "at_step")
        d = GatePolicy().decide(GateObservation(g, (value,)))
        assert isinstance(d, Prune) == want, (case, g, value, d)
        seen["prune" if want else "go on"] += 1
    assert all(v >= 5 for v in seen.values()), seen  # every branch of the table is exercised


def test_hyperband_auto_gives_gates_once_a_trial_is_complete():
    """Hyperband's ``max_resource: auto`` (what ``elastic sweep`` sets when the base job has
    no ``max_steps``): no gate before any trial is complete (the pruner answers "go on" there
    too); after one, the gate exists at the rung's step, its brackets set up as the pruner sets
    them up, and agrees with a twin pruner's decision."""
    pruner = optuna.pruners.HyperbandPruner(min_resource=2, max_resource="auto",
                                            reduction_factor=2)
    study = optuna.create_study(pruner=pruner, study_name="auto")  # brackets by name: fixed
    twin = copy.deepcopy(pruner)  # decides; no gate touches it
    first = study.ask()
    assert all(halving_gate(study, first._trial_id, first.number, s, 1) is None  # noqa: SLF001
               for s in range(1, 20))
    for s in range(300):
        first.report(1.0, s)
        assert not first.should_prune()
    study.tell(first, 1.0)
    said = []
    for v in (1.0, 3.0, 0.5, 5.0, 2.0, 4.0, 6.0, 0.1):  # trials after it, each to its rung
        trial = study.ask()
        gates = {s: g for s in range(1, 300) if (g := halving_gate(
            study, trial._trial_id, trial.number, s, 1)) is not None}  # noqa: SLF001
        assert gates, "no gate after a complete trial"
        step = min(gates)
        for s in range(step + 1):
            trial.report(v, s)
        want = twin.prune(study, study._storage.get_trial(trial._trial_id))  # noqa: SLF001
        d = GatePolicy().decide(GateObservation(gates[step], (v,)))
        assert isinstance(d, Prune) == want, (v, step, gates[step])
        said.append(want)
        if want:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, v)
    assert any(said) and not all(said), said


def test_hyperband_auto_is_set_up_once_when_trials_ask_at_once():
    """The trials of a sweep share one pruner across threads, and each refreshes its gate
    every second: right after the first trial completes, several set Hyperband's brackets up
    at once. Optuna checks, reads the storage, then appends, so two at once doubled the
    brackets and later trials failed ("unreachable" in ``_get_bracket_id``)."""
    import threading
    import time as _time

    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto",
                                            reduction_factor=2)
    study = optuna.create_study(pruner=pruner)
    study.add_trial(optuna.trial.create_trial(value=1.0, intermediate_values={99: 1.0}))
    trials = [study.ask() for _ in range(4)]
    slow_reads = study.get_trials

    def get_trials(*a, **kw):  # the storage read in the middle of Optuna's set-up, widened
        _time.sleep(0.05)
        return slow_reads(*a, **kw)

    study.get_trials = get_trials  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def ask(t: optuna.Trial) -> None:
        try:
            halving_gate(study, t._trial_id, t.number, 1, 1)  # noqa: SLF001
        except BaseException as e:  # noqa: BLE001 - collected for the assert
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(t,)) for t in trials]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(pruner._pruners) == pruner._n_brackets == 7  # noqa: SLF001 - log2(100) + 1


@pytest.mark.parametrize("gate, values, prunes", [
    (PruneGate(5, 1.0, None, 4, False, 1, "at_step"), (1.5,), True),
    (PruneGate(5, 1.0, None, 4, False, 1, "at_step"), (1.0,), False),  # equal: promoted
    (PruneGate(5, 1.0, None, 4, True, 1, "at_step"), (0.5,), True),  # maximize
    (PruneGate(5, math.inf, None, 4, False, 1, "at_step"), (math.inf,), False),  # alone
    (PruneGate(5, math.inf, None, 4, False, 1, "at_step"), (math.nan,), True),
    (PruneGate(5, math.nan, None, 4, True, 1, "at_step"), (-math.inf,), True),  # bootstrap
    (PruneGate(5, 1.0, None, 4, False, 1), (1.5,), True),
    (PruneGate(5, 1.0, 0.5, 4, False, 1), (1.5,), False),  # its best so far is better
    (PruneGate(5, 1.0, math.nan, 3, False, 1), (math.nan, 1.0), False),  # equal: kept
    (PruneGate(5, 1.0, math.nan, 3, False, 1), (math.nan, math.nan), True),  # no finite
    (PruneGate(5, math.nan, 9.0, 4, False, 1), (9.0,), False),  # too few complete trials
    (PruneGate(5, math.nan, None, 4, False, 1), (math.nan,), True),
    (PruneGate(5, 1.0, None, 4, True, 1), (0.5,), True),  # maximize: lower is worse
    (PruneGate(5, 1.0, 2.0, 2, True, 1), (0.5, 0.5, 0.5), False),
])
def test_gate_policy_table(gate, values, prunes):
    d = GatePolicy().decide(GateObservation(gate, values))
    assert isinstance(d, Prune if prunes else GoOn) and d.reason.startswith("step 5")


def test_a_trial_hands_out_one_gate_per_decision_step_and_refreshes_it():
    """The hook's gate: none before the start-up trials are complete, none in exact mode or
    under a Hyperband whose brackets wait for a complete trial; one per decision step, re-read after ``REFRESH_S`` and handed out under
    a new version only when its threshold changed."""
    spec = PruneSteps.of({"type": "median", "n_warmup_steps": 2, "interval_steps": 3})
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1,
                                                                   n_warmup_steps=2,
                                                                   interval_steps=3))
    hook = TrialSteps(study.ask(), spec)
    assert hook.gate(0) is None  # no complete trial yet
    study.add_trial(optuna.trial.create_trial(
        value=1.0, intermediate_values={s: 1.0 / (s + 1) for s in range(10)}))
    hook.refresh_s = 0.0
    g = hook.gate(0)
    assert g is not None and (g.step, g.through, g.best, g.version) == (2, -1, None, 1)
    assert g.threshold == 1.0 / 3
    assert hook.gate(1) is g  # refreshed, threshold unchanged: the same gate
    for s in range(3):
        hook.on_step({"step": s, "loss": 0.1, "world_size": 1})
    g5 = hook.gate(3)
    assert (g5.step, g5.through, g5.best, g5.version) == (5, 2, 0.1, 2)
    study.add_trial(optuna.trial.create_trial(
        value=1.0, intermediate_values={s: 2.0 for s in range(10)}))
    g5b = hook.gate(4)
    assert g5b.version == 3 and g5b.threshold == pytest.approx((1.0 / 6 + 2.0) / 2)
    # a long interval: once the driver has GATE_SPAN more steps than the gate says, a new
    # version carries them (the workers keep a few thousand losses, not every one)
    from elastic.sweep.trial_steps import GATE_SPAN

    far = PruneSteps.of({"type": "median", "n_warmup_steps": 5000, "interval_steps": 1})
    long = TrialSteps(study.ask(), far)
    long.refresh_s = 0.0
    first = long.gate(0)
    for s in range(GATE_SPAN - 1):
        long.on_step({"step": s, "loss": 0.5, "world_size": 1})
    assert long.gate(GATE_SPAN - 1) is first
    long.on_step({"step": GATE_SPAN - 1, "loss": 0.5, "world_size": 1})
    again = long.gate(GATE_SPAN)
    assert again.version == first.version + 1 and again.through == GATE_SPAN - 1
    assert TrialSteps(study.ask(), spec, exact=True).gate(0) is None
    hb = PruneSteps.of({"type": "hyperband", "min_resource": 1, "reduction_factor": 3})
    assert TrialSteps(optuna.create_study(pruner=optuna.pruners.HyperbandPruner()).ask(),
                      hb).gate(0) is None


def test_pruning_hook_pauses_only_in_exact_mode_and_watches_the_decision_steps():
    spec = PruneSteps.of({"type": "median", "n_warmup_steps": 3, "interval_steps": 4})
    study = optuna.create_study()
    default, exact = TrialSteps(study.ask(), spec), TrialSteps(study.ask(), spec, exact=True)
    assert default.pause_after(4) is None
    assert exact.pause_after(4) == 7
    assert default.watch_at(4) == 7 and exact.watch_at(8) == 11
    none = TrialSteps(study.ask(), PruneSteps.of({"type": "none"}))
    assert none.watch_at(0) is None and none.pause_after(0) is None


def test_a_queued_trial_opens_its_study_before_its_first_step(tmp_path, monkeypatch):
    """``ScheduledHook.open_soon`` (called when the scheduler queues the trial) opens the study
    in the background: the trial's steps never wait on the storage (a trial of short steps
    once trained to its end while its first step opened the study)."""
    import pickle

    from elastic.sweep.trial_steps import ScheduledHook

    url = f"sqlite:///{tmp_path}/study.db"
    trial = optuna.create_study(study_name="q", storage=url).ask()
    hook = pickle.loads(pickle.dumps(ScheduledHook(  # as the scheduler's process gets it
        url, "q", trial._trial_id, optuna.pruners.MedianPruner(),  # noqa: SLF001
        PruneSteps.of({"type": "median"}))))
    opened: list[str] = []
    real = optuna.load_study
    monkeypatch.setattr(optuna, "load_study",
                        lambda **kw: opened.append(kw["study_name"]) or real(**kw))
    hook.open_soon().join(30)
    assert opened == ["q"]
    assert hook.on_step({"step": 0, "loss": 1.0, "world_size": 1}) is False
    hook.finish()
    assert opened == ["q"]  # the step used the study opened before it
    assert optuna.load_study(study_name="q", storage=url).trials[0].intermediate_values == {
        0: 1.0}
