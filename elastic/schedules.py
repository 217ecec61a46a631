"""Learning-rate schedules: a function of the step giving a multiplier of the optimizer's lr.

A job's ``lr_schedule`` is ``step -> multiplier``, as for ``torch.optim.lr_scheduler.LambdaLR``:
the update of step ``s`` (0-based) uses ``lr * f(s)``, where ``lr`` is what the optimizer
factory set. elastic applies it itself before each step instead of keeping a scheduler object,
because the step is part of the job's state: a switch, a recovery, a resharded resume or a
fork continues the schedule exactly where it was, with no scheduler state to carry.

Built in (``{name: ..., ...}`` in YAML; ``total_steps`` defaults to the job's ``max_steps``):

- ``constant``: ``warmup_steps`` of linear warm-up, then 1 (it takes no ``total_steps``);
- ``linear``: warm-up, then linear decay to ``min_ratio`` at ``total_steps``;
- ``cosine``: warm-up, then half a cosine down to ``min_ratio`` at ``total_steps``.

Warm-up is ``(s + 1) / warmup_steps`` for ``s < warmup_steps``: the first step already
trains, and step ``warmup_steps - 1`` reaches the full rate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

__all__ = ["constant", "linear", "cosine", "BUILT_IN", "make_schedule"]


def _warmup(step: int, warmup_steps: int) -> float | None:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return None


def _progress(step: int, total_steps: int, warmup_steps: int) -> float:
    span = max(1, total_steps - warmup_steps)
    return min(1.0, max(0.0, (step - warmup_steps) / span))


def constant(step: int, *, warmup_steps: int = 0, total_steps: int = 0) -> float:
    w = _warmup(step, warmup_steps)
    return 1.0 if w is None else w


def linear(step: int, *, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0
           ) -> float:
    w = _warmup(step, warmup_steps)
    if w is not None:
        return w
    return 1.0 - (1.0 - min_ratio) * _progress(step, total_steps, warmup_steps)


def cosine(step: int, *, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0
           ) -> float:
    w = _warmup(step, warmup_steps)
    if w is not None:
        return w
    p = _progress(step, total_steps, warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


BUILT_IN: dict[str, Callable[..., float]] = {"constant": constant, "linear": linear,
                                             "cosine": cosine}
_KEYS = {"warmup_steps", "total_steps", "min_ratio"}


def make_schedule(spec: dict[str, Any], max_steps: int) -> Callable[[int], float]:
    """``{name: cosine, warmup_steps: 100, min_ratio: 0.1}`` -> ``step -> multiplier``.
    Raises ValueError for an unknown name or a key the schedule does not take; the values
    are the config's to check, each by its name (``config.schedule_check``)."""
    name = str(spec.get("name", "")).lower()
    if name not in BUILT_IN:
        raise ValueError(f"unknown schedule {spec.get('name')!r}; use one of "
                         f"{', '.join(BUILT_IN)} or an import string of step -> multiplier")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    # constant has no end to reach (was: total_steps taken, and ignored)
    allowed = {"warmup_steps"} if name == "constant" else _KEYS
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"{name} takes {', '.join(sorted(allowed))}, not {unknown[0]}")
    if name != "constant":
        kwargs.setdefault("total_steps", max_steps)
    return functools.partial(BUILT_IN[name], **kwargs)
