"""Checks of single values, shared by the config sections. Each returns the value (normalised
where said) or raises one ``ConfigError`` naming the setting and the fix.

A value read from YAML may be text where a number was meant: PyYAML reads ``1e-3`` (no decimal
point) as the string ``"1e-3"``. The number checks say so instead of a bare "not a number".
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from elastic.errors import ConfigError

__all__ = [
    "did_you_mean",
    "unknown",
    "integer",
    "optional_integer",
    "number",
    "one_of",
    "flag",
    "optional_flag",
    "text",
    "mapping",
]


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (difflib), or None when none is close."""
    near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
    return near[0] if near else None


def unknown(field: str, name: str, known: Iterable[str], what: str) -> ConfigError:
    """The error for an unknown key ``name`` at ``field``: a "did you mean", else the list."""
    known = sorted(known)
    near = did_you_mean(name, known)
    fix = f"did you mean {near}?" if near else f"use one of: {', '.join(known)}"
    return ConfigError(field, f"is not {what}.", fix)


def _yaml_text(value: Any) -> str:
    """A hint for text that reads as a number."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return (" (text: YAML reads a number such as 1e-3 without a decimal point as a string;"
                " write 1.0e-3)")
    return ""


def integer(value: Any, key: str, low: int = 1, fix: str | None = None) -> int:
    """An int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(key, f"must be {what}, got {value!r}{_yaml_text(value)}.",
                          fix or f"set {key}: {max(low, 1)} or more")
    return value


def optional_integer(value: Any, key: str, low: int = 1, fix: str | None = None) -> int | None:
    """None, or ``integer(value, key, low)``."""
    return None if value is None else integer(value, key, low, fix)


def number(value: Any, key: str, low: float = 0.0, *, above: bool = False,
           fix: str | None = None) -> float:
    """A finite int or float (not a bool), >= ``low`` (> ``low`` when ``above``); returned
    as given (an int stays an int)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value > low if above else value >= low))
    if not ok:
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ConfigError(key, f"must be a finite number {bound}, got {value!r}"
                          f"{_yaml_text(value)}.", fix or f"e.g. {key}: {max(low, 1.0):g}")
    return value  # type: ignore[no-any-return]


def one_of(value: Any, key: str, choices: Iterable[str], fix: str | None = None) -> str:
    """One of ``choices`` (strings)."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        near = did_you_mean(str(value), choices) if isinstance(value, str) else None
        hint = f"did you mean {near}? " if near else ""
        raise ConfigError(key, f"unknown value {value!r}.",
                          fix or f"{hint}use one of: {', '.join(choices)}")
    return value


def flag(value: Any, key: str) -> bool:
    """A bool (YAML true/false)."""
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}.", f"set {key}: true or false")
    return value


def optional_flag(value: Any, key: str, none_means: str) -> bool | None:
    """None or a bool."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(key, f"must be true, false or left out, got {value!r}.",
                          f"leave it out for {none_means}")
    return value


def text(value: Any, key: str, *, optional: bool = True, fix: str | None = None) -> str | None:
    """A non-empty string (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a non-empty string, got {value!r}.",
                          fix or (f"give {key} as text" + (", or leave it out" if optional else "")))
    return value


def mapping(value: Any, key: str, fix: str) -> dict[str, Any]:
    """A mapping with string keys, copied into a plain dict."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key, f"must be a mapping of names to values, got {value!r}.", fix)
    return dict(value)
