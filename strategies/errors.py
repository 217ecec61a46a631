"""The one error a layout raises for a spec, world size or model it cannot run with.

Torch-free, so that the torch-free parts of the package (``traits``, ``spec``, ``registry``)
raise it too.
"""

from __future__ import annotations

__all__ = ["StrategyError"]


class StrategyError(ValueError):
    """A strategy cannot run with this spec, world size or model; the message says why and
    names the fix."""
