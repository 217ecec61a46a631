"""What a sweep prints: one line per finished trial, and the summary table of a study."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from .study import trial_counts

__all__ = ["fmt", "trial_line", "format_summary"]


def fmt(v: Any) -> str:
    """A value as the tables show it: floats to 4 significant digits."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def trial_line(trial: optuna.trial.FrozenTrial) -> str:
    """``trial 3 complete: 0.0123 (optimizer.lr=0.01; world 2, dp, 4.1s, runs/s/trial-0003)``.
    A failed trial never ran as a job, so its line says why and how long it took instead
    of a world and a strategy it never had."""
    params = ", ".join(f"{k}={fmt(v)}" for k, v in trial.params.items())
    a = trial.user_attrs
    if trial.state == TrialState.COMPLETE:
        what = f"complete: {fmt(trial.value)}"
    elif trial.state == TrialState.PRUNED:
        what = f"pruned at step {a.get('pruned_at_step')}"
    elif trial.state == TrialState.FAIL:
        what = "failed: " + str(a.get("error") or "no value (a non-finite objective, or see "
                                "the log above)")
    else:
        what = trial.state.name.lower()
    ran = [f"world {a['world_size']}"] if a.get("world_size") is not None else []
    ran += [str(a["strategy"])] if a.get("strategy") else []
    if a.get("seconds") is not None:
        ran.append(f"{'after ' if not ran else ''}{a['seconds']}s")
    ran += [str(a["run_dir"])] if a.get("run_dir") else []
    detail = "; ".join(x for x in (params, ", ".join(ran)) if x)
    return f"trial {trial.number} {what}" + (f" ({detail})" if detail else "")


def format_summary(study: optuna.Study, max_rows: int = 20) -> str:
    """A plain-text table: counts per state, the best trial and its parameters, the trials."""
    trials = study.get_trials(deepcopy=False)
    c = trial_counts(study)
    lines = [f"study {study.study_name}: {len(trials)} trials: {c['complete']} complete, "
             f"{c['pruned']} pruned, {c['fail']} failed, {c['running']} running, "
             f"{c['waiting']} waiting"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        lines.append(f"best: trial {best.number}, value {fmt(best.value)}, "
                     f"run directory {best.user_attrs.get('run_dir')}")
        lines += [f"  {k} = {fmt(v)}" for k, v in best.params.items()]
    else:
        lines.append("best: no complete trial yet")
    names = sorted({k for t in trials for k in t.params})
    head = ["trial", "state", "value", "steps", "world", "ran_as", *names]
    rows = [[str(t.number), t.state.name.lower(), fmt(t.value) if t.value is not None else "-",
             str(t.user_attrs.get("steps", "-")), str(t.user_attrs.get("world_size", "-")),
             str(t.user_attrs.get("strategy", "-")), *[fmt(t.params.get(n, "-")) for n in names]]
            for t in trials[:max_rows]]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    if len(trials) > max_rows:
        lines.append(f"... {len(trials) - max_rows} more trials")
    return "\n".join(lines)
