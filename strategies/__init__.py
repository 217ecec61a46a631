"""Parallel layouts (PyTorch only, never Ray): data parallel, ZeRO 1/2/3, pipelines, hybrids."""

from .base import (
    CanonicalState,
    Runtime,
    Strategy,
    StrategyError,
    StrategySpec,
    state_hash,
)
from .registry import get, names, register

__all__ = [
    "CanonicalState",
    "Runtime",
    "Strategy",
    "StrategyError",
    "StrategySpec",
    "state_hash",
    "get",
    "names",
    "register",
]
