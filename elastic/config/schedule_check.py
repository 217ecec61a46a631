"""The values of a built-in learning-rate schedule (``lr_schedule: {name: ..., ...}``), each
named (``lr_schedule.total_steps``) with its fix; which keys a schedule takes is
``elastic.schedules.make_schedule``'s to say."""

from __future__ import annotations

from typing import Any

from elastic.errors import ConfigError

from .checks import integer, number

__all__ = ["schedule_values"]


def schedule_values(spec: dict[str, Any], max_steps: int) -> None:
    """A built-in schedule's values, each named (``lr_schedule.total_steps``), once its name
    and keys passed ``make_schedule``. Was: a total_steps of -5 or "1000" taken (lr 0 from
    step 1, or a TypeError at step 0)."""
    if "warmup_steps" in spec:
        integer(spec["warmup_steps"], "lr_schedule.warmup_steps", 0,
                "e.g. warmup_steps: 100, or leave it out (no warm-up)")
    if "min_ratio" in spec:
        ratio = number(spec["min_ratio"], "lr_schedule.min_ratio",
                       fix="give the final lr as a fraction of it, e.g. min_ratio: 0.1")
        if ratio > 1:
            raise ConfigError("lr_schedule.min_ratio", f"must be at most 1, got {ratio!r}.",
                              "give the final lr as a fraction of it, e.g. min_ratio: 0.1")
    name = str(spec.get("name", "")).lower()
    if "total_steps" not in spec or name not in ("linear", "cosine"):
        return
    total = integer(spec["total_steps"], "lr_schedule.total_steps", 1,
                    "leave it out (max_steps), or e.g. total_steps: 1000")
    if total < max_steps and not spec.get("min_ratio"):
        raise ConfigError("lr_schedule.total_steps",
                          f"{total} is less than max_steps={max_steps}: {name} decays to 0 at "
                          f"step {total}, so the last {max_steps - total} steps would train "
                          "with lr 0.",
                          "set total_steps to max_steps or leave it out (it defaults to "
                          "max_steps), or give min_ratio > 0 to hold that fraction of the lr "
                          "after it")
