"""Name -> Strategy class. The only place that maps strategy names to code."""

from __future__ import annotations

from .base import Strategy, StrategyError

__all__ = ["register", "get", "names"]

_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Strategy]:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise StrategyError(
            f"unknown strategy {name!r}; choose one of {', '.join(names())}"
        ) from None


def names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    # Imported lazily so that importing the registry has no side effects.
    import importlib

    for mod in ("dp", "zero", "fsdp", "pipeline"):
        try:
            importlib.import_module(f"strategies.{mod}")
        except ModuleNotFoundError as e:  # a strategy module not written yet
            if e.name != f"strategies.{mod}":
                raise
