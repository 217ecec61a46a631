"""Parallel layouts (PyTorch only, never Ray): data parallel, ZeRO 1/2/3, pipelines, hybrids."""

# Imported before any process group exists, on purpose: its functions take
# ``group=group.WORLD`` as a default argument, evaluated at import. Imported later (DDP does it
# lazily) they would pin the first default group for the life of the process, and a gloo
# group closes its sockets only when its last reference goes: after a node loss, peers
# blocked on a rank that has left would wait out the group timeout instead of failing at once.
import torch.distributed.nn.functional  # noqa: F401

from .base import (
    CanonicalState,
    Runtime,
    Strategy,
    StrategyError,
    StrategySpec,
    before_update,
    check_layout,
    on_before_update,
    state_hash,
)
from .registry import get, names, register
from .resharding import ReshardResult, reshard

__all__ = [
    "CanonicalState",
    "Runtime",
    "Strategy",
    "StrategyError",
    "StrategySpec",
    "state_hash",
    "check_layout",
    "reshard",
    "ReshardResult",
    "on_before_update",
    "before_update",
    "get",
    "names",
    "register",
]
