"""Parallel layouts (PyTorch only, never Ray): data parallel, ZeRO 1/2/3, pipelines, hybrids.

Importing the package imports no torch: the torch-free names (errors, traits, specs, the
registry's names) load at once, the torch-backed ones (``Strategy``, ``Runtime``, ``reshard``
...) on first access (PEP 562). ``strategies.base``, which every torch-backed name comes
through, imports ``torch.distributed.nn.functional`` first (see its comment).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import StrategyError
from .registry import get, names
from .spec import Degrees, StrategyOptions, StrategySpec
from .traits import TRAITS, Traits

if TYPE_CHECKING:
    from .base import Runtime, Strategy, before_update, check_layout, on_before_update
    from .canonical import CanonicalState, state_hash
    from .resharding import ReshardResult, reshard

__all__ = [
    "CanonicalState",
    "Degrees",
    "Runtime",
    "Strategy",
    "StrategyError",
    "StrategyOptions",
    "StrategySpec",
    "TRAITS",
    "Traits",
    "state_hash",
    "check_layout",
    "reshard",
    "ReshardResult",
    "on_before_update",
    "before_update",
    "get",
    "names",
]

# torch-backed names -> the module that defines them
_LAZY = {
    "Runtime": "base",
    "Strategy": "base",
    "check_layout": "base",
    "on_before_update": "base",
    "before_update": "base",
    "CanonicalState": "canonical",
    "state_hash": "canonical",
    "reshard": "resharding",
    "ReshardResult": "resharding",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    if module != "base":
        importlib.import_module(".base", __name__)  # its early import comes first, always
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
