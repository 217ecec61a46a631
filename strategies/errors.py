"""The one error a layout raises for a spec, world size or model it cannot run with.

Torch-free, so that the torch-free parts of the package (``traits``, ``spec``, ``registry``)
raise it too.
"""

from __future__ import annotations

__all__ = ["StrategyError"]


class StrategyError(ValueError):
    """A strategy cannot run with this spec, world size or model; the message says why and
    names the fix. ``setting``: the job setting that mends it, where one does (a worker then
    reports it as that setting's error, not as the user's code failing)."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting

    def __reduce__(self) -> tuple[object, ...]:  # (the setting kept through pickling)
        return (type(self), (str(self), self.setting))
