"""A pruner's decision, computed ahead and handed to a trial's workers.

Optuna's ``PercentilePruner`` (``MedianPruner`` is its 50th percentile) prunes at a decision
step when the trial's best value so far is worse than the percentile of the complete trials'
values at that step. Everything but the trial's own values is known before the step runs, so
the driver sends the workers a ``clusters.sweep_policy.PruneGate`` for the next decision step
(``gate_for``), and they apply ``GatePolicy`` to the loss they agreed on at that step's end:
a pruned trial stops at its decision step whatever its step time, where a stop sent by the
driver lands tens of milliseconds later (tens of ~2 ms steps). The driver still reports every
value, and still asks the pruner itself at a step the workers did not decide (a gate that had
not reached every rank, a trial whose complete trials changed meanwhile): a gate can make a
prune come earlier, never suppress one.

Successive halving (each of Hyperband's brackets is one) decides at a rung's promotion step
``min_resource * reduction_factor ** (min_early_stopping_rate + rung)``: the trial is
promoted iff its value at that step is among the best ``1 / reduction_factor`` of the values
every trial of its bracket reached at the rung (Optuna's ``SuccessiveHalvingPruner``; a NaN
value, or fewer trials at the rung than ``bootstrap_count``, prunes). The other trials'
values at the rung are in the study before the step runs, so that rule too is a threshold:
the k-th best of them, k = (n + 1) // reduction_factor - 1 (at least 0) for n of them
(``halving_gate``). The driver still asks the pruner at that step, gate or no gate: its
``should_prune`` writes the trial's rung value into the study (``completed_rung_<k>``), which
the trials after it compare against.

The threshold is the study's as of when the gate was computed (it is refreshed every
``REFRESH_S`` while the trial runs): a trial that completes (or reaches the rung) in between is
counted at the next decision step, as with any asynchronous pruner. Hyperband's
``max_resource: auto`` (its brackets, from the complete trials' last steps, set up once at the
pruner's first decision) is set up here the same way on the same pruner object, by whichever
comes first, the gate or the pruner's own ``prune``, under ``HALVING_LOCK``; before any trial
is complete there is no gate, and the pruner answers "go on" there too. No gate is made over a
rung where another trial's value is NaN (Optuna's order of NaNs is the sort's): there the
driver decides alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

from clusters.sweep_policy import PruneGate

__all__ = ["HALVING_LOCK", "REFRESH_S", "best_of", "gate_for", "halving_gate", "halving_of",
           "percentile_of"]

REFRESH_S = 1.0  # a gate's threshold is read from the study again after this long
# Optuna's Hyperband sets its brackets up in place at its first decision (a check, then
# appends), and a study's trials
# share one pruner across threads (``study.optimize(n_jobs=...)``): two set-ups at once
# doubled the brackets, and ``_get_bracket_id`` then raised. Gates and ``should_prune`` under
# successive halving take this lock.
HALVING_LOCK = threading.RLock()


def percentile_of(pruner: Any) -> tuple[float, int, int] | None:
    """(percentile, n_startup_trials, n_min_trials) of a ``PercentilePruner`` (the median
    pruner included); None for any other pruner (its decisions stay the driver's)."""
    if not isinstance(pruner, optuna.pruners.PercentilePruner):
        return None
    try:
        return (float(pruner._percentile), int(pruner._n_startup_trials),  # noqa: SLF001
                int(pruner._n_min_trials))  # noqa: SLF001
    except AttributeError:  # another Optuna's internals: no gates, the driver decides
        return None


def best_of(values: Iterable[float], maximize: bool) -> float | None:
    """The best of ``values`` as the pruner reads it: None for none, NaN when none is
    finite, else the largest (``maximize``) or smallest finite one."""
    seen = False
    best = math.nan
    for v in values:
        seen = True
        if not math.isnan(v) and (math.isnan(best) or (v > best if maximize else v < best)):
            best = v
    return best if seen else None


def gate_for(study: optuna.Study, step: int, best: float | None, through: int,
             version: int) -> PruneGate | None:
    """The gate of decision step ``step`` for a trial whose best value over its steps up to
    ``through`` is ``best`` (``best_of``; as the driver has them), or None when the pruner
    cannot prune there (not a percentile pruner, fewer complete trials than its start-up
    count)."""
    spec = percentile_of(study.pruner)
    if spec is None:
        return None
    pct, n_startup, n_min = spec
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done or len(done) < n_startup:
        return None
    maximize = study.direction == StudyDirection.MAXIMIZE
    at = [t.intermediate_values[step] for t in done if step in t.intermediate_values]
    threshold = math.nan
    if len(at) >= n_min and any(not math.isnan(v) for v in at):
        threshold = float(np.nanpercentile(np.asarray(at, dtype=float),
                                           100 - pct if maximize else pct))
    return PruneGate(step, threshold, best, through, maximize, version)


def halving_of(study: optuna.Study, number: int
               ) -> tuple[Any, Callable[[], Any]] | None:
    """The ``SuccessiveHalvingPruner`` that decides for trial ``number`` of ``study`` and a
    function returning the study it reads (under Hyperband: the trial's bracket, and a view
    of the study with that bracket's trials only: made on demand, it reads the storage);
    None for another pruner, or a Hyperband with ``max_resource: auto`` before any trial is
    complete (its brackets are not known yet)."""
    p = study.pruner
    try:
        if isinstance(p, optuna.pruners.HyperbandPruner):
            if not p._pruners:  # noqa: SLF001
                p._try_initialization(study)  # noqa: SLF001 - what its first prune() does
                if not p._pruners:  # noqa: SLF001 - max_resource "auto", no complete trial:
                    return None  # its prune() answers False too
            bracket = p._get_bracket_id(  # noqa: SLF001 - it reads only the number
                study, cast(optuna.trial.FrozenTrial, SimpleNamespace(number=number)))
            return (p._pruners[bracket],  # noqa: SLF001
                    lambda: p._create_bracket_study(study, bracket))  # noqa: SLF001
        if isinstance(p, optuna.pruners.SuccessiveHalvingPruner):
            return p, lambda: study
    except (AttributeError, IndexError, TypeError):  # another Optuna's internals: no gates
        return None
    return None


def halving_gate(study: optuna.Study, trial_id: int, number: int, step: int,
                 version: int) -> PruneGate | None:
    """The gate of decision step ``step`` of trial ``trial_id`` (``number``) under
    successive halving or Hyperband, or None when the pruner does not decide there (not
    the promotion step of the trial's current rung) or the driver must (see the module)."""
    with HALVING_LOCK:
        return _halving_gate(study, trial_id, number, step, version)


def _halving_gate(study: optuna.Study, trial_id: int, number: int, step: int,
                  version: int) -> PruneGate | None:
    found = halving_of(study, number)
    if found is None:
        return None
    sh, view = found
    try:
        lo, eta = sh._min_resource, int(sh._reduction_factor)  # noqa: SLF001
        rate, boot = int(sh._min_early_stopping_rate), int(sh._bootstrap_count)  # noqa: SLF001
    except AttributeError:
        return None
    if not isinstance(lo, int):  # a bare successive halving's "auto" (sweeps build
        return None  # Hyperband, whose brackets' min_resource is an integer): the driver
    attrs = study._storage.get_trial_system_attrs(trial_id)  # noqa: SLF001
    rung = 0
    while f"completed_rung_{rung}" in attrs:
        rung += 1
    if lo * eta ** (rate + rung) != step:
        return None
    key = f"completed_rung_{rung}"
    others = [float(t.system_attrs[key]) for t in view().get_trials(deepcopy=False)
              if key in t.system_attrs and t._trial_id != trial_id]  # noqa: SLF001
    if any(math.isnan(v) for v in others):
        return None
    maximize = study.direction == StudyDirection.MAXIMIZE
    n = len(others)
    if n + 1 <= boot:
        threshold = math.nan  # every value pruned
    elif n == 0:
        threshold = -math.inf if maximize else math.inf  # the only one there: promoted
    else:
        k = max(0, (n + 1) // eta - 1)
        ranked = sorted(others)
        threshold = ranked[-(k + 1)] if maximize else ranked[k]
    return PruneGate(step, threshold, None, step - 1, maximize, version, rule="at_step")
