"""Name -> Strategy class. The only place that maps strategy names to code.

Torch-free until a class is asked for: ``names()`` lists the layouts without importing them,
and ``get(name)`` imports the one module that implements ``name``. The layouts do not import
this module (so no import cycle runs through it). A new layout is one entry here and one
``Traits`` in ``strategies.traits.TRAITS`` (a test checks that the two name the same set).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import StrategyError

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["get", "names"]

# name -> (module, class)
_LAYOUTS: dict[str, tuple[str, str]] = {
    "dp": ("strategies.dp", "DataParallel"),
    "zero1": ("strategies.zero", "Zero1"),
    "zero2": ("strategies.zero", "Zero2"),
    "zero3": ("strategies.fsdp", "FullyShardedDataParallel"),
    "pipeline": ("strategies.pipeline", "Pipeline"),
}


def get(name: str) -> type[Strategy]:
    """The class of strategy ``name``. Raises ``StrategyError`` naming the known ones."""
    if name not in _LAYOUTS:
        raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(names())}")
    module, attr = _LAYOUTS[name]
    cls: type[Strategy] = getattr(importlib.import_module(module), attr)
    return cls


def names() -> list[str]:
    """Every strategy name, sorted (imports no layout)."""
    return sorted(_LAYOUTS)
