"""The median pruner's decision, computed ahead and handed to a trial's workers.

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

The threshold is the study's as of when the gate was computed (it is refreshed every
``REFRESH_S`` while the trial runs): a trial that completes in between is counted at the next
decision step, as with any asynchronous pruner. Successive halving and Hyperband (whose rung
decisions write to the study) are decided by the driver only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

from clusters.sweep_policy import PruneGate

__all__ = ["REFRESH_S", "best_of", "gate_for", "percentile_of"]

REFRESH_S = 1.0  # a gate's threshold is read from the study again after this long


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
